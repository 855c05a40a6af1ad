//! The paged journal (`backend::paged`): seals equal the codec's records of the fp16-rounded
//! rows, reopened blocks keep their records, sinks leave least recently used first, outputs do
//! not depend on how the rows were chunked, and refused calls change nothing.

use half::f16;
use sjkvarn::backend::paged::{
    PageDtype, PagedError, PagedJournal, PagedSettings, Pages, PagesMut, StepPlan, WindowJournal,
    WindowPages, WindowPagesMut, BLOCK,
};
use sjkvarn::codec::extension::records::encode_records;
use sjkvarn::rng::SplitMix64;

const KVH: usize = 2;
const QH: usize = 6;
const D: usize = 64;
const W: usize = KVH * D;

fn rows(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64::new(seed);
    let k = rng.gaussians(n * W).iter().map(|x| x + 0.5).collect();
    (k, rng.gaussians(n * W), rng.gaussians(n * QH * D))
}

fn journal(settings: PagedSettings) -> PagedJournal {
    PagedJournal::new(settings, KVH, D, PageDtype::F32, None).unwrap()
}

fn slots(table: &[usize], range: std::ops::Range<usize>) -> Vec<i64> {
    range
        .map(|p| (table[p / BLOCK] * BLOCK + p % BLOCK) as i64)
        .collect()
}

fn plan(table: &[usize], queries: usize, len: usize) -> StepPlan {
    let bt: Vec<i64> = table.iter().map(|&b| b as i64).collect();
    StepPlan::new(&[0, queries as i64], &[len as i64], &bt, table.len(), BLOCK).unwrap()
}

/// Feeds positions in `chunks` as an engine would; returns every output row.
fn run(
    j: &mut PagedJournal,
    pages: &mut [u8],
    count: usize,
    (k, v, q): (&[f32], &[f32], &[f32]),
    table: &[usize],
    chunks: &[usize],
) -> Vec<f32> {
    let (mut out, mut pos) = (Vec::new(), 0);
    for &size in chunks {
        let s = slots(table, pos..pos + size);
        let (kk, vv) = (&k[pos * W..(pos + size) * W], &v[pos * W..(pos + size) * W]);
        j.write(
            PagesMut {
                bytes: pages,
                count,
            },
            kk,
            vv,
            &s,
        )
        .unwrap();
        let p = plan(table, size, pos + size);
        let qs = &q[pos * QH * D..(pos + size) * QH * D];
        let pages_ro = Pages {
            bytes: pages,
            count,
        };
        out.extend(j.attend(pages_ro, &p, qs, QH, 0.125).unwrap());
        j.forget(p.live_sinks());
        pos += size;
    }
    out
}

/// Block `b`'s rows of `[tokens][KVH][D]`, rounded to fp16, as tiles `[KVH][BLOCK][D]`.
fn fp16_tiles(x: &[f32], b: usize) -> Vec<f32> {
    let mut out = vec![0.0; KVH * BLOCK * D];
    for t in 0..BLOCK {
        for h in 0..KVH {
            for i in 0..D {
                let x = x[((b * BLOCK + t) * KVH + h) * D + i];
                out[(h * BLOCK + t) * D + i] = f16::from_f32(x).to_f32();
            }
        }
    }
    out
}

#[test]
fn sealed_pages_are_the_codec_records_of_the_fp16_rows() {
    for settings in [
        PagedSettings::default(),
        PagedSettings::new(3, 2, "trellis", true, false, 256).unwrap(),
    ] {
        let mut j = journal(settings);
        let page = j.page_bytes();
        let mut pages = vec![0u8; 4 * page];
        let (k, v, _) = rows(2 * BLOCK + 7, 1);
        let table = [3, 1, 2];
        // Out of order and in pieces: the record depends only on the block's rows.
        for range in [BLOCK..2 * BLOCK + 7, 0..50, 50..BLOCK] {
            let s = slots(&table, range.clone());
            let (kk, vv) = (
                &k[range.start * W..range.end * W],
                &v[range.start * W..range.end * W],
            );
            j.write(
                PagesMut {
                    bytes: &mut pages,
                    count: 4,
                },
                kk,
                vv,
                &s,
            )
            .unwrap();
        }
        let codec = settings.codec(D).unwrap();
        for (b, &id) in table[..2].iter().enumerate() {
            let want = encode_records(&codec, &fp16_tiles(&k, b), &fp16_tiles(&v, b), false, None)
                .unwrap();
            assert_eq!(&pages[id * page..(id + 1) * page], &want[..], "block {b}");
        }
        // The open third block has no record yet; page 0 was never touched.
        assert!(pages[2 * page..3 * page].iter().all(|&x| x == 0));
        assert!(pages[..page].iter().all(|&x| x == 0));
        assert_eq!(j.open_blocks(), vec![1, 2, 3]);
    }
}

#[test]
fn outputs_do_not_depend_on_chunking() {
    let n = 3 * BLOCK + 40;
    let (k, v, q) = rows(n, 2);
    let table = [7, 3, 9, 4];
    let runs: Vec<Vec<f32>> = [
        vec![n],
        vec![100, 200, n - 300],
        vec![BLOCK, BLOCK, BLOCK, 40],
    ]
    .iter()
    .map(|chunks| {
        let mut j = journal(PagedSettings::default());
        let mut pages = vec![0u8; 10 * j.page_bytes()];
        run(&mut j, &mut pages, 10, (&k, &v, &q), &table, chunks)
    })
    .collect();
    for other in &runs[1..] {
        for (a, b) in runs[0].iter().zip(other) {
            assert!((a - b).abs() <= 1e-6 + 1e-5 * b.abs(), "{a} vs {b}");
        }
    }
    // Not a constant: the queries see different positions.
    assert!(runs[0][..QH * D] != runs[0][(n - 1) * QH * D..]);
}

#[test]
fn reopened_block_keeps_its_record_and_its_rows() {
    let mut j = journal(PagedSettings::new(4, 4, "scalar", false, false, 256).unwrap());
    let page = j.page_bytes();
    let mut pages = vec![0u8; 3 * page];
    let (k, v, q) = rows(2 * BLOCK, 3);
    let table = [1, 2];
    let first = run(&mut j, &mut pages, 3, (&k, &v, &q), &table, &[2 * BLOCK]);
    assert!(
        j.open_blocks().is_empty(),
        "sealed blocks are dropped (no sink kept)"
    );
    let before = pages.clone();
    // The engine recomputes the cached block's last token.
    let last = 2 * BLOCK - 1;
    let s = slots(&table, last..last + 1);
    let (kk, vv) = (&k[last * W..], &v[last * W..]);
    j.write(
        PagesMut {
            bytes: &mut pages,
            count: 3,
        },
        kk,
        vv,
        &s,
    )
    .unwrap();
    assert_eq!(pages, before);
    assert_eq!(j.open_blocks(), vec![2]);
    let p = plan(&table, 1, 2 * BLOCK);
    let again = j.attend(
        Pages {
            bytes: &pages,
            count: 3,
        },
        &p,
        &q[last * QH * D..],
        QH,
        0.125,
    );
    let again = again.unwrap();
    // The own block now reads decoded rows (rounded to fp16): close to the exact answer.
    for (a, b) in again.iter().zip(&first[last * QH * D..]) {
        assert!((a - b).abs() < 0.05, "{a} vs {b}");
    }
}

#[test]
fn sinks_leave_least_recently_used_first() {
    let mut j = journal(PagedSettings::new(4, 4, "scalar", true, false, 2).unwrap());
    let mut pages = vec![0u8; 8 * j.page_bytes()];
    let (k, v, q) = rows(BLOCK, 4);
    for first in [5, 6, 7] {
        run(&mut j, &mut pages, 8, (&k, &v, &q), &[first], &[BLOCK]);
    }
    assert_eq!(j.sink_blocks(), vec![6, 7]);
    // A step touching 6 makes 7 the oldest.
    j.forget(&[6]);
    assert_eq!(j.sink_blocks(), vec![7, 6]);
    run(&mut j, &mut pages, 8, (&k, &v, &q), &[4], &[BLOCK]);
    assert_eq!(j.sink_blocks(), vec![6, 4]);
    // A block reused from offset 0 is no sink any more.
    run(&mut j, &mut pages, 8, (&k, &v, &q), &[6], &[10]);
    assert_eq!(j.sink_blocks(), vec![4]);
    assert_eq!(j.open_blocks(), vec![6]);
}

#[test]
fn refused_writes_and_reads_change_nothing() {
    let mut j = journal(PagedSettings::default());
    let page = j.page_bytes();
    let mut pages = vec![0u8; 2 * page];
    let (mut k, v, q) = rows(4, 5);
    let slots: Vec<i64> = (0..4).map(|i| BLOCK as i64 + i).collect();
    k[7] = f32::NAN;
    let err = j.write(
        PagesMut {
            bytes: &mut pages,
            count: 2,
        },
        &k,
        &v,
        &slots,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("NaN")));
    k[7] = 7e4;
    let err = j.write(
        PagesMut {
            bytes: &mut pages,
            count: 2,
        },
        &k,
        &v,
        &slots,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("float16")));
    k[7] = 0.0;
    let past: Vec<i64> = vec![0, 1, 2, 2 * BLOCK as i64];
    let err = j.write(
        PagesMut {
            bytes: &mut pages,
            count: 2,
        },
        &k,
        &v,
        &past,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("past the last page")));
    // Continuing a block (offset 5) that was never written.
    let later: Vec<i64> = (5..9).collect();
    let err = j.write(
        PagesMut {
            bytes: &mut pages,
            count: 2,
        },
        &k,
        &v,
        &later,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("never written")));
    let err = j.write(
        PagesMut {
            bytes: &mut pages[..page + 3],
            count: 2,
        },
        &k,
        &v,
        &slots,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("KV page")));
    assert!(pages.iter().all(|&x| x == 0) && j.open_blocks().is_empty());
    // Reading a block that holds no rows and no record.
    let p = plan(&[0, 1], 1, BLOCK + 1);
    let err = j.attend(
        Pages {
            bytes: &pages,
            count: 2,
        },
        &p,
        &q[..QH * D],
        QH,
        0.125,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("never written")));
}

#[test]
fn step_plan_splits_requests_by_block() {
    // Request 0: 300 positions, the last 200 new; request 1: decoding its 129th token;
    // request 2: no queries this step but alive (its sink stays live).
    let table = [4, 5, 6, 0, 8, 9, 0, 0, 3, 0, 0, 0];
    let p = StepPlan::new(&[0, 200, 201, 201], &[300, 129, 10], &table, 4, BLOCK).unwrap();
    let got: Vec<_> = p
        .query_blocks()
        .iter()
        .map(|b| (b.span, b.queries.clone(), b.position, b.block))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, 0..28, 100, 0),
            (0, 28..156, 128, 1),
            (0, 156..200, 256, 2),
            (1, 200..201, 128, 1)
        ]
    );
    assert_eq!(p.live_sinks(), &[3, 4, 8]);
    assert_eq!(p.table(&p.spans()[1]), &[8, 9]);
    assert_eq!(p.window_first_block(300, Some(100)), 1);
    for (qs, lens, what) in [
        (vec![0, 5], vec![4], "only 4 positions"),
        (vec![0, 1, 2], vec![1], "query_start holds"),
        (vec![0, 1], vec![BLOCK as i64 * 5], "the table holds 4"),
        (vec![2, 1], vec![5], "must not decrease"),
    ] {
        let err = StepPlan::new(&qs, &lens, &table[..4 * (qs.len() - 1)], 4, BLOCK);
        assert!(
            matches!(err, Err(PagedError::Invalid(m)) if m.contains(what)),
            "{what}"
        );
    }
}

#[test]
fn settings_are_checked_with_named_values() {
    for (args, want) in [
        (
            (5, 4, "scalar", 256),
            "k_bits and v_bits must be 2..4, got 5/4",
        ),
        (
            (4, 4, "lattice", 256),
            "body must be one of ('scalar', 'trellis'), got 'lattice'",
        ),
        ((4, 4, "trellis", 256), "trellis bodies code k_bits/v_bits"),
        (
            (4, 4, "scalar", -1),
            "max_sink_blocks must be at least 0, got -1",
        ),
    ] {
        let (k, v, body, max) = args;
        let err = PagedSettings::new(k, v, body, true, false, max).unwrap_err();
        assert!(err.to_string().contains(want), "{err}");
    }
    let s = PagedSettings::default();
    assert_eq!(s.state_bytes(64, PageDtype::F32).unwrap(), 9344);
    assert_eq!(s.window_block_tokens(64).unwrap(), 32);
    // SmolLM2's geometry at 8k tokens: bf16 pages against records plus the two exact blocks.
    let lossless = PagedSettings::new(4, 4, "scalar", true, true, 256).unwrap();
    let plain = lossless.sequences_per_gib(8192, 30, 3, 64, PageDtype::Bf16, 0, 0);
    assert_eq!(
        plain.unwrap(),
        (1u64 << 30) as f64 / (64 * 30 * 3 * 128 * 2 * 64 * 2) as f64
    );
    let coded = s
        .sequences_per_gib(8192, 30, 3, 64, PageDtype::Bf16, 0, 0)
        .unwrap();
    let side = 2 * 30 * 2 * 128 * 3 * 64 * 2;
    assert_eq!(
        coded,
        (1u64 << 30) as f64 / (30 * 64 * 3 * 9344 + side) as f64
    );
    assert!(s
        .sequences_per_gib(8192, 3, 3, 64, PageDtype::Bf16, 4, 512)
        .is_err());
}

#[test]
fn window_layers_keep_exact_rows_in_padded_pages() {
    let settings = PagedSettings::default();
    let tokens = settings.window_block_tokens(D).unwrap();
    let stride = KVH * settings.state_bytes(D, PageDtype::F32).unwrap();
    let count = 4;
    let mut pages = vec![0u8; count * stride];
    let j = WindowJournal::new(KVH, D, 30).unwrap();
    let n = 2 * tokens + 3;
    let (k, v, _) = rows(n, 6);
    let table = [2, 0, 3];
    let s: Vec<i64> = (0..n)
        .map(|p| (table[p / tokens] * tokens + p % tokens) as i64)
        .collect();
    let mk = |bytes: &mut [u8]| -> Result<(), PagedError> {
        let pages = WindowPagesMut {
            bytes,
            count,
            page_stride: stride,
            tokens,
        };
        j.write(pages, &k, &v, &s)
    };
    mk(&mut pages).unwrap();
    let bt: Vec<i64> = table.iter().map(|&b| b as i64).collect();
    let p = StepPlan::new(&[0, 1], &[n as i64], &bt, 3, tokens).unwrap();
    let pages_ro = WindowPages {
        bytes: &pages,
        count,
        page_stride: stride,
        tokens,
    };
    let dense = j.dense(pages_ro, &p, 0).unwrap();
    // The last query (position n-1) reads from position n-30 on: blocks 1 and 2.
    assert_eq!(dense.first_position, tokens);
    assert_eq!(dense.tokens, 2 * tokens);
    for h in 0..KVH {
        for t in 0..n - tokens {
            for i in 0..D {
                let want = f16::from_f32(k[((tokens + t) * KVH + h) * D + i]).to_f32();
                assert_eq!(dense.k[(h * dense.tokens + t) * D + i], want);
            }
        }
    }
    let before = pages.clone();
    let mut bad = k.clone();
    bad[0] = f32::INFINITY;
    let err = j.write(
        WindowPagesMut {
            bytes: &mut pages,
            count,
            page_stride: stride,
            tokens,
        },
        &bad,
        &v,
        &s,
    );
    assert!(matches!(err, Err(PagedError::Invalid(m)) if m.contains("NaN or Inf")));
    assert_eq!(pages, before);
    assert!(WindowJournal::new(KVH, D, 0).is_err());
}
