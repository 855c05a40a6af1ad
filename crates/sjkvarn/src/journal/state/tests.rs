use super::*;

const RECORD: usize = 300;
/// A tq6_0 K row and V row.
const STAGE: usize = 2 * 98;

fn identity() -> StateIdentity {
    StateIdentity {
        head_dim: 128,
        n_head_kv: 2,
        group: 128,
        sink: 128,
        sink_type: SINK_F16,
        bits_k: 3,
        bits_v: 3,
        body: BODY_TRELLIS,
        iters: 16,
        staging: STAGING_TQ6_0,
        tail: 256,
        tail_max: 512,
        flush_chunk: 1,
        codebook_id: codebook_id(BODY_TRELLIS, &[0x3c00, 0x4000], &[0xbc00]),
        n_layers: 2,
        rotation: ROTATION_HADAMARD,
    }
}

/// Deterministic content of an item: every byte depends on the item and its offset.
fn content(item: StateItem, dst: &mut [u8]) {
    let (tag, l, i, h) = match item {
        StateItem::SinkRow { layer, pos, head } => (1u64, layer, pos, head),
        StateItem::Record { layer, group, head } => (2, layer, group, head),
        StateItem::TailRow { layer, pos, head } => (3, layer, pos, head),
    };
    let seed = (tag << 48) ^ (u64::from(l) << 40) ^ (u64::from(i) << 8) ^ u64::from(h);
    for (k, b) in dst.iter_mut().enumerate() {
        *b = (fnv1a64(&(seed ^ ((k as u64) << 20)).to_le_bytes()) >> 7) as u8;
    }
}

/// A header grown by the policy to `n` stored positions.
fn grown(id: StateIdentity, n: u32) -> StateHeader {
    let mut p = Policy::new(id.sink, id.tail, id.tail_max, id.group, id.flush_chunk);
    let mut pos = 0;
    while pos < n {
        let k = 3.min(n - pos);
        p.begin_ubatch(pos, k);
        p.commit();
        pos += k;
    }
    StateHeader::from_policy(id, &p, n).unwrap()
}

fn stream(h: &StateHeader) -> Vec<u8> {
    write_state_vec(h, RECORD, STAGE, &mut content).unwrap()
}

fn refix(s: &mut [u8]) {
    let n = s.len();
    let sum = fnv1a64(&s[..n - 8]);
    s[n - 8..].copy_from_slice(&sum.to_le_bytes());
}

/// peek + identity check, as a restore does.
fn accept(s: &[u8], id: &StateIdentity) -> Result<StateInfo, StateError> {
    let info = peek(s)?;
    check_identity(&info, id, RECORD, STAGE)?;
    Ok(info)
}

#[test]
fn round_trip_is_byte_exact() {
    for (sink_type, staging) in [(SINK_F16, STAGING_TQ6_0), (SINK_INHERIT, STAGING_F16)] {
        let stage = if staging == STAGING_F16 { 512 } else { STAGE };
        let id = StateIdentity {
            sink_type,
            staging,
            ..identity()
        };
        for n in [0, 77, 128, 700, 1300] {
            let h = grown(id, n);
            let s = write_state_vec(&h, RECORD, stage, &mut content).unwrap();
            assert_eq!(s.len(), h.stream_bytes(RECORD, stage).unwrap());
            let info = peek(&s).unwrap();
            assert_eq!(info.header, h);
            assert_eq!(info.total_bytes, s.len());
            check_identity(&info, &id, RECORD, stage).unwrap();
            info.check_capacity(2304, 17, 1024).unwrap();
            // read every item back, compare it, and write it again from what was read
            let mut seen = Vec::new();
            walk_payload(&s, &info, RECORD, stage, |item, bytes| {
                let mut want = vec![0; bytes.len()];
                content(item, &mut want);
                assert_eq!(bytes, &want[..], "{item:?}");
                seen.push((item, bytes.to_vec()));
            })
            .unwrap();
            let mut it = seen.into_iter();
            let again = write_state_vec(
                &info.header,
                RECORD,
                stage,
                &mut |item: StateItem, dst: &mut [u8]| {
                    let (i, b) = it.next().unwrap();
                    assert_eq!(i, item);
                    dst.copy_from_slice(&b);
                },
            )
            .unwrap();
            assert_eq!(again, s, "n {n}: write -> read -> write differs");
        }
    }
}

#[test]
fn layout_matches_reference_offsets() {
    let id = identity();
    let h = grown(id, 1300);
    assert!(h.b > id.sink && h.b <= 1300);
    let s = stream(&h);
    assert_eq!(&s[..8], b"SJKVSEQ\0");
    let u = |at: usize| u32::from_le_bytes(s[at..at + 4].try_into().unwrap());
    assert_eq!((u(8), u(12), u(16)), (1, 1, 128));
    assert_eq!((u(20), u(24), u(28), u(32), u(36)), (128, 2, 128, 128, 0));
    assert_eq!((u(40), u(44), u(48), u(52), u(56)), (3, 3, 1, 16, 0));
    assert_eq!((u(60), u(64), u(68), u(72), u(76)), (256, 512, 1, 1, 128));
    assert_eq!(
        u64::from_le_bytes(s[80..88].try_into().unwrap()),
        id.codebook_id
    );
    assert_eq!(
        (u(88), u(92), u(96), u(100), u(104)),
        (2, 1300, h.b, h.b_prev, h.draining)
    );
    assert!(s[116..128].iter().all(|&b| b == 0));
    let per_layer = 128 * 2 * 512
        + ((h.b - 128) / 128) as usize * 2 * RECORD
        + (1300 - h.b) as usize * 2 * STAGE;
    assert_eq!(h.payload_bytes(RECORD, STAGE), Some(per_layer as u64));
    let payload = u64::from_le_bytes(s[108..116].try_into().unwrap());
    assert_eq!(payload, 2 * per_layer as u64);
    assert_eq!(s.len(), 128 + 2 * per_layer + 8);
    // first payload bytes: sink row (layer 0, pos 0, head 0); checksum over all before it
    let mut first = vec![0; 512];
    content(
        StateItem::SinkRow {
            layer: 0,
            pos: 0,
            head: 0,
        },
        &mut first,
    );
    assert_eq!(&s[128..640], &first[..]);
    let n = s.len();
    assert_eq!(fnv1a64(&s[..n - 8]).to_le_bytes(), s[n - 8..]);
}

#[test]
fn damaged_streams_each_report_their_error() {
    let id = identity();
    let s = stream(&grown(id, 1300));
    let n = s.len();
    let damaged = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut x = s.clone();
        f(&mut x);
        accept(&x, &id)
    };
    assert!(accept(&s, &id).is_ok());
    assert_eq!(damaged(&|x| x[0] = b'X'), Err(StateError::Magic));
    assert_eq!(damaged(&|x| x[8] = 2), Err(StateError::Version(2)));
    assert_eq!(accept(&s[..n - 1], &id), Err(StateError::Truncated));
    assert_eq!(accept(&s[..100], &id), Err(StateError::Truncated));
    assert_eq!(accept(&s[..4], &id), Err(StateError::Truncated));
    assert_eq!(accept(&[], &id), Err(StateError::Truncated));
    assert!(matches!(
        damaged(&|x| x[n / 2] ^= 0x10),
        Err(StateError::Corrupt(_))
    ));
    assert!(matches!(
        damaged(&|x| x[n - 1] ^= 1),
        Err(StateError::Corrupt(_))
    ));
    assert!(matches!(
        damaged(&|x| x[16] = 64),
        Err(StateError::Corrupt(_))
    ));
    assert_eq!(
        damaged(&|x| {
            x[12] = 2;
            refix(x)
        }),
        Err(StateError::Format(2))
    );
    let b_off = damaged(&|x| {
        x[96] = x[96].wrapping_add(1);
        refix(x)
    });
    assert_eq!(
        b_off,
        Err(StateError::Corrupt("sealed end off a group boundary"))
    );
    let n_off = damaged(&|x| {
        x[92] = x[92].wrapping_add(1);
        refix(x)
    });
    assert!(matches!(n_off, Err(StateError::Corrupt(m)) if m.contains("payload length")));
    let drain = damaged(&|x| {
        x[104] = 2;
        refix(x)
    });
    assert_eq!(
        drain,
        Err(StateError::Corrupt("draining flag is not 0 or 1"))
    );
    // a payload length past the end of the buffer
    assert_eq!(
        damaged(&|x| {
            x[108..116].copy_from_slice(&u64::MAX.to_le_bytes());
        }),
        Err(StateError::Truncated)
    );
    // a walk over a stream whose header disagrees with the caller's sizes never panics
    let info = peek(&s).unwrap();
    assert!(walk_payload(&s, &info, RECORD + 1, STAGE, |_, _| panic!("no items")).is_err());
    assert!(walk_payload(&s[..n - 9], &info, RECORD, STAGE, |_, _| panic!("no items")).is_err());
}

#[test]
fn mismatches_each_report_their_error() {
    use StateError as E;
    let id = identity();
    let s = stream(&grown(id, 1300));
    let with = |f: &dyn Fn(&mut StateIdentity)| {
        let mut c = id;
        f(&mut c);
        accept(&s, &c).unwrap_err()
    };
    assert!(matches!(
        with(&|c| c.head_dim = 256),
        E::HeadDim {
            state: 128,
            cache: 256
        }
    ));
    assert!(matches!(with(&|c| c.n_head_kv = 1), E::NHeadKv { .. }));
    assert!(matches!(with(&|c| c.group = 64), E::Group { .. }));
    assert!(matches!(with(&|c| c.sink = 192), E::Sink { .. }));
    assert!(matches!(
        with(&|c| c.sink_type = SINK_INHERIT),
        E::Sink { .. }
    ));
    assert!(matches!(with(&|c| c.bits_v = 2), E::Bits { .. }));
    assert!(matches!(with(&|c| c.body = BODY_SCALAR), E::Body { .. }));
    assert!(matches!(with(&|c| c.iters = 8), E::Iters { .. }));
    assert!(matches!(
        with(&|c| c.staging = STAGING_F16),
        E::Staging { .. }
    ));
    assert!(matches!(with(&|c| c.tail = 384), E::Tail { .. }));
    assert!(matches!(with(&|c| c.tail_max = 0), E::Tail { .. }));
    assert!(matches!(with(&|c| c.flush_chunk = 2), E::Tail { .. }));
    assert!(matches!(with(&|c| c.codebook_id ^= 1), E::Codebook { .. }));
    assert!(matches!(
        with(&|c| c.n_layers = 3),
        E::NLayers { state: 2, cache: 3 }
    ));
    // first differing field wins, in the reference's order
    assert!(matches!(
        with(&|c| {
            c.n_layers = 3;
            c.bits_k = 4
        }),
        E::Bits { .. }
    ));
    // fields the config cannot express: rewrite them and fix the checksum
    let rewritten = |at: usize, v: u8| {
        let mut x = s.clone();
        x[at] = v;
        refix(&mut x);
        accept(&x, &id).unwrap_err()
    };
    assert!(matches!(
        rewritten(72, 2),
        E::Rotation {
            state: (2, 128),
            ..
        }
    ));
    assert!(matches!(
        rewritten(76, 64),
        E::Rotation { state: (1, 64), .. }
    ));
    assert!(matches!(rewritten(80, s[80] ^ 1), E::Codebook { .. }));
    // capacity of the restoring cache
    let info = peek(&s).unwrap();
    assert!(matches!(
        info.check_capacity(1024, 100, 4096),
        Err(E::Capacity(_))
    ));
    assert!(matches!(
        info.check_capacity(2304, 1, 4096),
        Err(E::Capacity(_))
    ));
    assert!(matches!(
        info.check_capacity(2304, 100, 8),
        Err(E::Capacity(_))
    ));
}

#[test]
fn writer_refuses_pending_inconsistent_and_small() {
    let id = identity();
    let mut p = Policy::new(id.sink, id.tail, id.tail_max, id.group, id.flush_chunk);
    p.begin_ubatch(2000, 200);
    assert_eq!(
        StateHeader::from_policy(id, &p, 2000),
        Err(StateError::Pending)
    );
    let h = grown(id, 900);
    let mut small = vec![0; 16];
    assert!(matches!(
        write_state(&h, RECORD, STAGE, &mut content, &mut small),
        Err(StateError::Buffer { have: 16, .. })
    ));
    let bad = StateHeader { b: h.b + 1, ..h };
    assert!(matches!(
        write_state_vec(&bad, RECORD, STAGE, &mut content),
        Err(StateError::Corrupt(_))
    ));
    let zero_group = StateHeader {
        identity: StateIdentity { group: 0, ..id },
        ..h
    };
    assert!(write_state_vec(&zero_group, RECORD, STAGE, &mut content).is_err());
}

#[test]
fn codebook_and_checksum() {
    assert_eq!(fnv1a64(b""), FNV_OFFSET);
    // the reference's offset basis, not the textbook 0xcbf29ce484222325
    assert_eq!(FNV_OFFSET, 0x1465_0fb0_739d_0383);
    assert_eq!(fnv1a64(b"a"), 0x44bd_8ad4_73cd_9906);
    assert_eq!(codebook_id(BODY_SCALAR, &[1, 2], &[3]), 0);
    let want = fnv1a64(&[0x00, 0x3c, 0x00, 0x40, 0x00, 0xbc]);
    assert_eq!(
        codebook_id(BODY_TRELLIS, &[0x3c00, 0x4000], &[0xbc00]),
        want
    );
    // K then V, continued: not the same as V then K
    assert_ne!(
        codebook_id(BODY_TRELLIS, &[0xbc00], &[0x3c00, 0x4000]),
        want
    );
}
