//! GPU tests of the casts between f32 and bf16/f16 (`cudagraph_nn::cast`): every cast against
//! the `half` crate's conversions on the host, bit for bit (a NaN only has to stay a NaN: the
//! device gives the canonical NaN, `half` keeps the payload); lengths that differ are a typed
//! error; the casts captured in a graph replay equal to the eager ones, bit for bit.

use cudagraph::memory::{bf16, f16};
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, QueueExt, Stream};
use cudagraph_nn::{cast, HostRng, NnError};

/// Values that probe every case of the narrowing: signed zeros, infinities, NaNs, f32
/// subnormals, f16 subnormals and the ties around them, the largest finite bf16 and f16 and
/// the values just below, at and past their rounding boundaries, ties to even in the normal
/// range, and the f32 extremes.
fn edge_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::from_bits(0xffc0_1234),
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1), // smallest f32 subnormal
        f32::from_bits(0x807f_ffff),
        f32::EPSILON,
        1.0,
        -1.0,
        // bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (ties to 1), 1 + 3·2^-8 ties up.
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        1.0 + 2f32.powi(-8) + 2f32.powi(-20),
        // f16: 1 + 2^-11 ties to 1, 1 + 3·2^-11 ties up.
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-11) + 2f32.powi(-20),
        // The largest finite f16 (65504), the boundary to inf (65520), around them.
        65504.0,
        -65504.0,
        65519.996,
        65520.0,
        -65520.0,
        65536.0,
        1.0e5,
        // f16 subnormals: 2^-24 is the smallest, 2^-25 ties to 0, 3·2^-25 ties to 2·2^-24.
        2f32.powi(-24),
        -2f32.powi(-24),
        2f32.powi(-25),
        -2f32.powi(-25),
        2f32.powi(-25) * 1.000_001,
        3.0 * 2f32.powi(-25),
        5.0 * 2f32.powi(-25),
        2f32.powi(-26),
        2f32.powi(-14),                  // the smallest normal f16
        2f32.powi(-14) - 2f32.powi(-24), // the largest subnormal f16
        2f32.powi(-14) - 2f32.powi(-25), // halfway between them: ties up to the normal
        6.1e-5,
        // The largest finite bf16 and the values past it.
        bf16::MAX.to_f32(),
        bf16::MIN.to_f32(),
        f32::from_bits(0x7f7f_7fff),
        f32::from_bits(0x7f7f_8000),
        f32::from_bits(0x7f7f_8001),
        f32::from_bits(0xff7f_8000),
        // bf16 subnormals and their ties.
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x0000_8001),
        f32::from_bits(0x0001_8000),
        f32::from_bits(0x007f_ffff),
    ];
    for e in -30..=20 {
        let x = 2f32.powi(e);
        v.extend([x, -x, x * 1.5, x * 0.999_999, x * 1.000_001]);
    }
    v
}

/// `n` f32 of every kind: normals at several scales, random bit patterns (all exponents,
/// NaNs and infinities included) and the edge values.
fn test_values(n: usize) -> Vec<f32> {
    let mut rng = HostRng::new(28);
    let mut v = edge_values();
    for scale in [1.0f32, 1e-6, 1e-3, 1e3, 3e4, 1e8] {
        v.extend(rng.vec_normal(n / 8).into_iter().map(|x| x * scale));
    }
    while v.len() < n {
        v.push(f32::from_bits(rng.next_u64() as u32));
    }
    v
}

/// Every f32 bit pattern with a step of `step`: a sweep of all exponents and mantissas.
fn sweep(step: u32) -> Vec<f32> {
    (0..=u32::MAX / step)
        .map(|i| f32::from_bits(i * step))
        .collect()
}

fn check_narrowing<H: Copy>(
    what: &str,
    src: &[f32],
    got: &[H],
    bits: impl Fn(H) -> u16,
    want: impl Fn(f32) -> u16,
    is_nan: impl Fn(u16) -> bool,
) {
    assert_eq!(src.len(), got.len());
    for (x, g) in src.iter().zip(got) {
        let g = bits(*g);
        if x.is_nan() {
            assert!(is_nan(g), "{what}: NaN {:#010x} gave {g:#06x}", x.to_bits());
        } else {
            let w = want(*x);
            assert_eq!(g, w, "{what}: {x:e} ({:#010x})", x.to_bits());
        }
    }
}

fn narrow(s: &Stream, src: &[f32]) {
    let d = s.alloc_from_host(src).unwrap();
    let b = s.alloc_zeroed::<bf16>(src.len()).unwrap();
    let h = s.alloc_zeroed::<f16>(src.len()).unwrap();
    cast::to_bf16(s, &d, &b).unwrap();
    cast::to_f16(s, &d, &h).unwrap();
    check_narrowing(
        "f32 → bf16",
        src,
        &s.to_vec(&b).unwrap(),
        bf16::to_bits,
        |x| bf16::from_f32(x).to_bits(),
        |g| bf16::from_bits(g).is_nan(),
    );
    check_narrowing(
        "f32 → f16",
        src,
        &s.to_vec(&h).unwrap(),
        f16::to_bits,
        |x| f16::from_f32(x).to_bits(),
        |g| f16::from_bits(g).is_nan(),
    );
}

#[test]
fn narrowing_casts_round_to_nearest_even_like_the_half_crate() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    narrow(&s, &edge_values());
    narrow(&s, &test_values(1 << 20));
    // 2^24 patterns spread over all 2^32 (a prime step, so every low-bit pattern occurs).
    narrow(&s, &sweep(251));
}

#[test]
fn widening_casts_are_exact_for_every_bf16_and_f16() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let b: Vec<bf16> = all.iter().map(|&x| bf16::from_bits(x)).collect();
    let h: Vec<f16> = all.iter().map(|&x| f16::from_bits(x)).collect();
    let db = s.alloc_from_host(&b).unwrap();
    let dh = s.alloc_from_host(&h).unwrap();
    let (fb, fh) = (
        s.alloc_zeroed::<f32>(all.len()).unwrap(),
        s.alloc_zeroed::<f32>(all.len()).unwrap(),
    );
    cast::from_bf16(&s, &db, &fb).unwrap();
    cast::from_f16(&s, &dh, &fh).unwrap();
    let (gb, gh) = (s.to_vec(&fb).unwrap(), s.to_vec(&fh).unwrap());
    for i in 0..all.len() {
        let (x, g) = (b[i], gb[i]);
        if x.is_nan() {
            assert!(g.is_nan(), "bf16 NaN {:#06x} gave {g}", x.to_bits());
        } else {
            assert_eq!(
                g.to_bits(),
                x.to_f32().to_bits(),
                "bf16 {:#06x}",
                x.to_bits()
            );
        }
        let (x, g) = (h[i], gh[i]);
        if x.is_nan() {
            assert!(g.is_nan(), "f16 NaN {:#06x} gave {g}", x.to_bits());
        } else {
            assert_eq!(
                g.to_bits(),
                x.to_f32().to_bits(),
                "f16 {:#06x}",
                x.to_bits()
            );
        }
    }
    // bf16 → f32 is the bits shifted up: NaN payloads are kept too.
    assert!(gb
        .iter()
        .zip(&all)
        .all(|(g, &x)| g.to_bits() == (x as u32) << 16));

    // Round trip: every finite bf16/f16 widened then narrowed is itself.
    let (rb, rh) = (
        s.alloc_zeroed::<bf16>(all.len()).unwrap(),
        s.alloc_zeroed::<f16>(all.len()).unwrap(),
    );
    cast::to_bf16(&s, &fb, &rb).unwrap();
    cast::to_f16(&s, &fh, &rh).unwrap();
    let (rb, rh) = (s.to_vec(&rb).unwrap(), s.to_vec(&rh).unwrap());
    for i in 0..all.len() {
        if !b[i].is_nan() {
            assert_eq!(rb[i].to_bits(), b[i].to_bits());
        }
        if !h[i].is_nan() {
            assert_eq!(rh[i].to_bits(), h[i].to_bits());
        }
    }
}

fn is_size_mismatch(e: NnError, expected: usize, got: usize) -> bool {
    matches!(
        e,
        NnError::Core(cudagraph::Error::SizeMismatch { expected: x, got: y, .. })
            if x == expected && y == got
    )
}

#[test]
fn casts_between_buffers_of_different_lengths_are_typed_errors() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let f = s.alloc_from_host(&[1.0f32; 10]).unwrap();
    let (b9, b11) = (
        s.alloc_zeroed::<bf16>(9).unwrap(),
        s.alloc_zeroed::<bf16>(11).unwrap(),
    );
    let (h9, h11) = (
        s.alloc_zeroed::<f16>(9).unwrap(),
        s.alloc_zeroed::<f16>(11).unwrap(),
    );
    assert!(is_size_mismatch(
        cast::to_bf16(&s, &f, &b9).unwrap_err(),
        10,
        9
    ));
    assert!(is_size_mismatch(
        cast::to_bf16(&s, &f, &b11).unwrap_err(),
        10,
        11
    ));
    assert!(is_size_mismatch(
        cast::to_f16(&s, &f, &h9).unwrap_err(),
        10,
        9
    ));
    assert!(is_size_mismatch(
        cast::to_f16(&s, &f, &h11).unwrap_err(),
        10,
        11
    ));
    assert!(is_size_mismatch(
        cast::from_bf16(&s, &b9, &f).unwrap_err(),
        9,
        10
    ));
    assert!(is_size_mismatch(
        cast::from_bf16(&s, &b11, &f).unwrap_err(),
        11,
        10
    ));
    assert!(is_size_mismatch(
        cast::from_f16(&s, &h9, &f).unwrap_err(),
        9,
        10
    ));
    assert!(is_size_mismatch(
        cast::from_f16(&s, &h11, &f).unwrap_err(),
        11,
        10
    ));
    // Nothing was written by the refused casts.
    assert!(s.to_vec(&b9).unwrap().iter().all(|x| x.to_bits() == 0));
    assert!(s.to_vec(&h11).unwrap().iter().all(|x| x.to_bits() == 0));
    // Empty buffers: nothing to do, no error.
    let (e32, eb, eh) = (
        s.alloc_zeroed::<f32>(0).unwrap(),
        s.alloc_zeroed::<bf16>(0).unwrap(),
        s.alloc_zeroed::<f16>(0).unwrap(),
    );
    cast::to_bf16(&s, &e32, &eb).unwrap();
    cast::to_f16(&s, &e32, &eh).unwrap();
    cast::from_bf16(&s, &eb, &e32).unwrap();
    cast::from_f16(&s, &eh, &e32).unwrap();
    // The stream is still usable.
    let b10 = s.alloc_zeroed::<bf16>(10).unwrap();
    cast::to_bf16(&s, &f, &b10).unwrap();
    assert!(s.to_vec(&b10).unwrap().iter().all(|x| x.to_f32() == 1.0));
}

struct Bufs {
    x: DeviceBuffer<f32>,
    b: DeviceBuffer<bf16>,
    h: DeviceBuffer<f16>,
    xb: DeviceBuffer<f32>,
    xh: DeviceBuffer<f32>,
}

fn bufs(s: &Stream, n: usize) -> Bufs {
    Bufs {
        x: s.alloc_zeroed(n).unwrap(),
        b: s.alloc_zeroed(n).unwrap(),
        h: s.alloc_zeroed(n).unwrap(),
        xb: s.alloc_zeroed(n).unwrap(),
        xh: s.alloc_zeroed(n).unwrap(),
    }
}

/// The four casts in a chain: x → bf16 → f32, x → f16 → f32.
fn chain(q: &dyn cudagraph::Queue, r: &Bufs) -> cudagraph_nn::Result<()> {
    cast::to_bf16(q, &r.x, &r.b)?;
    cast::to_f16(q, &r.x, &r.h)?;
    cast::from_bf16(q, &r.b, &r.xb)?;
    cast::from_f16(q, &r.h, &r.xh)
}

/// Every output's bits, widened to u32, one vector a buffer.
fn outputs(s: &Stream, r: &Bufs) -> [Vec<u32>; 4] {
    [
        s.to_vec(&r.b)
            .unwrap()
            .into_iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        s.to_vec(&r.h)
            .unwrap()
            .into_iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        s.to_vec(&r.xb)
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect(),
        s.to_vec(&r.xh)
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect(),
    ]
}

/// Fails at the first element whose bits differ (not with millions of elements printed).
fn assert_same_bits(got: &[Vec<u32>; 4], want: &[Vec<u32>; 4], what: &str) {
    let names = ["bf16", "f16", "bf16 → f32", "f16 → f32"];
    for ((g, w), name) in got.iter().zip(want).zip(names) {
        assert_eq!(g.len(), w.len(), "{what}: {name} length");
        if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
            panic!("{what}: {name}[{i}] is {:#x}, not {:#x}", g[i], w[i]);
        }
    }
}

#[test]
fn casts_captured_in_a_graph_replay_equal_to_eager_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    // More elements than one launch's blocks cover (65 536 × 256), so the grid-stride loop runs.
    let n = (1 << 24) + 12_345;
    let inputs = [test_values(n), sweep(255)[..n].to_vec()];

    let eager = bufs(&s, n);
    let graphed = bufs(&s, n);
    let (g, ()) =
        Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(chain(cs, &graphed)?)).unwrap();
    for input in &inputs {
        s.copy_from_host(input, &eager.x).unwrap();
        chain(&s, &eager).unwrap();
        s.copy_from_host(input, &graphed.x).unwrap();
        g.replay(&s).unwrap();
        let want = outputs(&s, &eager);
        assert_same_bits(&outputs(&s, &graphed), &want, "replay against eager");
        // Replaying again over the same input changes nothing.
        g.replay(&s).unwrap();
        assert_same_bits(&outputs(&s, &graphed), &want, "a second replay");
    }
}

/// Lengths around the groups of four the kernels move at once: every tail length, and a long
/// odd one, equal the host's rounding bit for bit (NaN-free values).
#[test]
fn casts_of_every_tail_length_match_the_host() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(41);
    for n in (1..=9).chain([1023, 4097, 65_539]) {
        let v: Vec<f32> = rng.vec_normal(n).into_iter().map(|x| x * 300.0).collect();
        let d = s.alloc_from_host(&v).unwrap();
        let b = s.alloc_zeroed::<bf16>(n).unwrap();
        let h = s.alloc_zeroed::<f16>(n).unwrap();
        cast::to_bf16(&s, &d, &b).unwrap();
        cast::to_f16(&s, &d, &h).unwrap();
        let (gb, gh) = (s.to_vec(&b).unwrap(), s.to_vec(&h).unwrap());
        for i in 0..n {
            assert_eq!(
                gb[i].to_bits(),
                bf16::from_f32(v[i]).to_bits(),
                "bf16 n={n} [{i}]"
            );
            assert_eq!(
                gh[i].to_bits(),
                f16::from_f32(v[i]).to_bits(),
                "f16 n={n} [{i}]"
            );
        }
        let (wb, wh) = (
            s.alloc_zeroed::<f32>(n).unwrap(),
            s.alloc_zeroed::<f32>(n).unwrap(),
        );
        cast::from_bf16(&s, &b, &wb).unwrap();
        cast::from_f16(&s, &h, &wh).unwrap();
        let (gwb, gwh) = (s.to_vec(&wb).unwrap(), s.to_vec(&wh).unwrap());
        for i in 0..n {
            assert_eq!(
                gwb[i].to_bits(),
                gb[i].to_f32().to_bits(),
                "bf16 → f32 n={n} [{i}]"
            );
            assert_eq!(
                gwh[i].to_bits(),
                gh[i].to_f32().to_bits(),
                "f16 → f32 n={n} [{i}]"
            );
        }
    }
}
