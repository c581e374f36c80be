//! [`parse_rows`]: a request body `{"inputs": [[...], ...]}` read straight into one flat
//! buffer, refused at the first value past the batcher's limits.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::ServeError;

/// A request's rows, parsed from its body: `rows * width` values, row after row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rows {
    /// The values, row-major.
    pub values: Vec<f32>,
    /// Number of rows.
    pub rows: usize,
}

/// Longest `reason` a [`ServeError::Malformed`] repeats from the parser (a message may quote
/// the client's input, which can be as long as the body).
pub(super) const REASON_CHARS: usize = 200;

/// Parses a request body `{"inputs": [[...], ...]}` (rows of `width` numbers, at most
/// `max_rows` rows) straight into one flat `Vec<f32>`, checking as it reads.
///
/// Memory stays bounded by the limits, not by what the client sends: values go into a single
/// buffer sized once (at most `width * max_rows` values, and never more than the body could
/// spell), and parsing stops at the first value that breaks a limit without reading the rest
/// of the body:
/// - a row with more than `width` values: [`ServeError::RowTooLong`] (fewer:
///   [`ServeError::RowWidth`]);
/// - a row past `max_rows`: [`ServeError::RowLimit`];
/// - a number outside `f32`'s range: [`ServeError::NonFinite`] (JSON has no NaN or infinity,
///   so `NaN` is malformed);
/// - no rows: [`ServeError::Empty`];
/// - anything else (an empty body, not JSON, another shape, unknown or repeated fields, a
///   value that is not a number, text after the object): [`ServeError::Malformed`], whose
///   reason says what and where.
///
/// ```
/// use cudagraph_nn::serving::{parse_rows, ServeError};
/// let r = parse_rows(br#"{"inputs": [[1, 2], [3.5, -4]]}"#, 2, 8).unwrap();
/// assert_eq!((r.rows, r.values), (2, vec![1.0, 2.0, 3.5, -4.0]));
/// // Stops at the third value of row 0: the rest is never read.
/// let e = parse_rows(br#"{"inputs": [[1, 2, 3, this is not JSON"#, 2, 8).unwrap_err();
/// assert_eq!(e, ServeError::RowTooLong { row: 0, expected: 2 });
/// ```
pub fn parse_rows(body: &[u8], width: usize, max_rows: usize) -> Result<Rows, ServeError> {
    let malformed = |reason: String| ServeError::Malformed {
        reason: truncate(reason),
        width,
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(malformed("empty body".into()));
    }
    // A value takes at least two bytes of the body (a digit and a separator).
    let capacity = width.saturating_mul(max_rows).min(body.len() / 2 + 1);
    let mut st = ParseState {
        width,
        max_rows,
        values: Vec::with_capacity(capacity),
        rows: 0,
        fault: None,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = BodySeed(&mut st)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    match parsed {
        Ok(()) if st.rows == 0 => Err(ServeError::Empty),
        Ok(()) => Ok(Rows {
            values: st.values,
            rows: st.rows,
        }),
        // A limit the visitors hit is kept typed; serde's error only carried it out.
        Err(e) => Err(st.fault.take().unwrap_or_else(|| malformed(e.to_string()))),
    }
}

fn truncate(mut s: String) -> String {
    if let Some((i, _)) = s.char_indices().nth(REASON_CHARS) {
        s.truncate(i);
        s.push('…');
    }
    s
}

struct ParseState {
    width: usize,
    max_rows: usize,
    values: Vec<f32>,
    rows: usize,
    fault: Option<ServeError>,
}

impl ParseState {
    /// Records why parsing stops; the returned error only unwinds the deserializer.
    fn fail<E: de::Error>(&mut self, why: ServeError) -> E {
        let e = E::custom(&why);
        self.fault = Some(why);
        e
    }
}

/// The body: an object whose only field is `inputs`.
struct BodySeed<'a>(&'a mut ParseState);

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object {\"inputs\": [[...], ...]}")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let mut seen = false;
        while let Some(InputsField) = map.next_key()? {
            if seen {
                return Err(de::Error::duplicate_field("inputs"));
            }
            seen = true;
            map.next_value_seed(RowsSeed(&mut *self.0))?;
        }
        if !seen {
            return Err(de::Error::missing_field("inputs"));
        }
        Ok(())
    }
}

/// The key `inputs`; any other is refused before its value is read.
struct InputsField;

impl<'de> Deserialize<'de> for InputsField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_identifier(InputsField)
    }
}

impl Visitor<'_> for InputsField {
    type Value = InputsField;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the field `inputs`")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<InputsField, E> {
        match v {
            "inputs" => Ok(InputsField),
            other => Err(E::unknown_field(other, &["inputs"])),
        }
    }
}

/// `inputs`: an array of at most `max_rows` rows.
struct RowsSeed<'a>(&'a mut ParseState);

impl<'de> DeserializeSeed<'de> for RowsSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RowsSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of rows")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let st = self.0;
        loop {
            if st.rows == st.max_rows {
                // Another row is one too many: refuse it before reading it.
                let max = st.max_rows;
                seq.next_element_seed(Refuse(&mut *st, ServeError::RowLimit { max }))?;
                return Ok(());
            }
            match seq.next_element_seed(RowSeed(&mut *st))? {
                Some(()) => st.rows += 1,
                None => return Ok(()),
            }
        }
    }
}

/// One row: exactly `width` numbers, each finite as an `f32`.
struct RowSeed<'a>(&'a mut ParseState);

impl<'de> DeserializeSeed<'de> for RowSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RowSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "a row of {} numbers", self.0.width)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let st = self.0;
        let (row, width) = (st.rows, st.width);
        let mut got = 0;
        loop {
            if got == width {
                // A value past the width: refuse it before reading it.
                let too_long = ServeError::RowTooLong {
                    row,
                    expected: width,
                };
                seq.next_element_seed(Refuse(&mut *st, too_long))?;
                return Ok(());
            }
            let Some(v) = seq.next_element::<f64>()? else {
                let short = ServeError::RowWidth {
                    row,
                    expected: width,
                    got,
                };
                return Err(st.fail(short));
            };
            let x = v as f32;
            if !x.is_finite() {
                // JSON numbers are finite; this one is beyond f32's range.
                let value = format!("{v:e} (beyond f32's range)");
                return Err(st.fail(ServeError::NonFinite {
                    row,
                    column: got,
                    value,
                }));
            }
            st.values.push(x);
            got += 1;
        }
    }
}

/// An element that must not be there: fails without reading it.
struct Refuse<'a>(&'a mut ParseState, ServeError);

impl<'de> DeserializeSeed<'de> for Refuse<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, _: D) -> std::result::Result<(), D::Error> {
        Err(self.0.fail(self.1))
    }
}
