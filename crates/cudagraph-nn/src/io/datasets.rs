//! Small real datasets shipped with the crate, for training runs that need no download.
//!
//! [`digits`]: the UCI handwritten digits (1797 images of 8×8 pixels, 10 classes; CC BY 4.0,
//! see `data/DIGITS-LICENSE.md`), embedded in the binary.

use crate::error::{NnError, Result};
use crate::random::HostRng;

const DIGITS_CSV: &str = include_str!("../../data/digits.csv");

/// Images (row-major, `n × features`, scaled to [0, 1]) with integer labels.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// `len() × features` pixel values in [0, 1], row-major.
    pub images: Vec<f32>,
    /// One class index per image, in `0..classes`.
    pub labels: Vec<i32>,
    /// Values per image (64 for the 8×8 digits).
    pub features: usize,
    /// Number of classes (10 for the digits).
    pub classes: usize,
}

impl Dataset {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Rows in `order`, as a new dataset.
    pub fn select(&self, order: &[usize]) -> Dataset {
        let f = self.features;
        Dataset {
            images: order
                .iter()
                .flat_map(|&i| self.images[i * f..(i + 1) * f].iter().copied())
                .collect(),
            labels: order.iter().map(|&i| self.labels[i]).collect(),
            features: f,
            classes: self.classes,
        }
    }

    /// A deterministic shuffle, then `test_fraction` of the rows held out: (train, test).
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let order = permutation(self.len(), seed);
        let n_test = ((self.len() as f64) * test_fraction).round() as usize;
        (self.select(&order[n_test..]), self.select(&order[..n_test]))
    }
}

/// A Fisher–Yates permutation of `0..n` from `seed`.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = HostRng::new(seed);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// Parses `pixels…,label` lines with `features` pixel columns valued 0..=`max`.
pub fn parse_csv(text: &str, features: usize, max: f32, classes: usize) -> Result<Dataset> {
    let mut images = Vec::new();
    let mut labels = Vec::new();
    for (line_no, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let vals: Vec<&str> = line.split(',').collect();
        if vals.len() != features + 1 {
            return Err(NnError::Data(format!(
                "line {}: {} columns, expected {}",
                line_no + 1,
                vals.len(),
                features + 1
            )));
        }
        for v in &vals[..features] {
            let p: f32 = v
                .trim()
                .parse()
                .map_err(|_| NnError::Data(format!("line {}: bad pixel {v:?}", line_no + 1)))?;
            images.push(p / max);
        }
        let label: i32 = vals[features]
            .trim()
            .parse()
            .map_err(|_| NnError::Data(format!("line {}: bad label", line_no + 1)))?;
        if label < 0 || label as usize >= classes {
            return Err(NnError::Data(format!(
                "line {}: label {label} out of range",
                line_no + 1
            )));
        }
        labels.push(label);
    }
    Ok(Dataset {
        images,
        labels,
        features,
        classes,
    })
}

/// The UCI handwritten digits: 1797 images, 64 features in [0, 1], 10 classes.
pub fn digits() -> Result<Dataset> {
    parse_csv(DIGITS_CSV, 64, 16.0, 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_load_with_all_classes() {
        let d = digits().unwrap();
        assert_eq!(d.len(), 1797);
        assert_eq!(d.images.len(), 1797 * 64);
        assert!(d.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
        let mut counts = [0usize; 10];
        for &l in &d.labels {
            counts[l as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 170), "{counts:?}");
        // The first image is a 0 (checked against the source file).
        assert_eq!(d.labels[0], 0);
    }

    #[test]
    fn split_is_a_partition() {
        let d = digits().unwrap();
        let (tr, te) = d.split(0.2, 7);
        assert_eq!(tr.len() + te.len(), d.len());
        assert_eq!(te.len(), 359);
        let mut sums = (tr.images.iter().sum::<f32>() + te.images.iter().sum::<f32>()) as f64;
        sums -= d.images.iter().sum::<f32>() as f64;
        assert!(sums.abs() < 1.0);
    }

    #[test]
    fn bad_rows_are_typed_errors() {
        assert!(matches!(
            parse_csv("1,2,3\n", 4, 16.0, 10),
            Err(NnError::Data(_))
        ));
        assert!(matches!(
            parse_csv("1,2,3,x,1\n", 4, 16.0, 10),
            Err(NnError::Data(_))
        ));
        assert!(matches!(
            parse_csv("1,2,3,4,12\n", 4, 16.0, 10),
            Err(NnError::Data(_))
        ));
    }
}
