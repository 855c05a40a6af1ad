//! A native server loop over the crate: a queue of requests, each a sequence on one shared record
//! pool; chunked prefill; decode steps round-robin across the live sequences; parallel sampling
//! with `fork` (the samples share the prompt's records); speculative decoding rolled back with
//! `truncate`; preemption by snapshot (swap out to a file, swap back in); finished sequences
//! retired, which frees their record slots.
//!
//! The "model" is random post-RoPE K, V and Q, so the example runs on its own.
//!
//! Run: `cargo run --release -p sjkvarn --example serve`

use sjkvarn::attention::attend;
use sjkvarn::backend::Sequence;
use sjkvarn::codec::extension::body::{BodyCoding, TrellisAxis};
use sjkvarn::error::CacheResult;
use sjkvarn::journal::{CacheConfig, LayerCoding};
use sjkvarn::rng::SplitMix64;
use sjkvarn::Journal;
use std::collections::VecDeque;
use std::sync::Arc;

/// Sequences decoded at once; the record pool is sized for them.
const MAX_LIVE: usize = 4;
/// Draft tokens a speculative step proposes.
const DRAFT: usize = 4;

/// A sequence being decoded: its request and the tokens it still has to produce.
struct Live {
    id: usize,
    seq: Sequence,
    left: usize,
}

/// The model stand-in: every token runs through every layer (append its K/V, attend its Q).
struct Model {
    config: Arc<CacheConfig>,
    rng: SplitMix64,
}

impl Model {
    fn forward(&mut self, seq: &mut Sequence, tokens: usize) -> CacheResult<()> {
        let c = &self.config;
        let (kv, q) = (c.kv_heads * c.head_dim, c.q_heads * c.head_dim);
        for layer in 0..c.layers {
            let k = self.rng.gaussians(tokens * kv);
            let v = self.rng.gaussians(tokens * kv);
            seq.append(layer, &k, &v)?;
            let out = attend(seq, layer, &self.rng.gaussians(tokens * q), None)?;
            assert!(out.iter().all(|x| x.is_finite()));
        }
        Ok(())
    }

    /// Prefill in the ubatches the journal allows (a seal can only run at a ubatch's start).
    fn prefill(&mut self, seq: &mut Sequence, prompt: usize) -> CacheResult<()> {
        while seq.len(0)? < prompt {
            let n = seq.chunk_limit(0)?.min(prompt - seq.len(0)?);
            self.forward(seq, n)?;
        }
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A small model: 4 layers, 8 query heads over 2 KV heads of 128, a 3/2 trellis body with the
    // first and last layers at 4/4 (tiered edge layers), a scaled-down 512/1,024 tail.
    let trellis = BodyCoding::Trellis(TrellisAxis::Token);
    let middle = LayerCoding {
        k_bits: 3,
        v_bits: 2,
        k_coding: trellis,
        v_coding: trellis,
    };
    let mut config = CacheConfig::recommended(4, 8, 2, 128, middle, 4096);
    config.layer_coding[0] = LayerCoding::scalar(4, 4);
    config.layer_coding[3] = LayerCoding::scalar(4, 4);
    (config.min_tail, config.max_tail, config.max_chunk) = (512, 1024, 256);
    config.validate()?;
    let config = Arc::new(config);
    let pool = Sequence::pool_for(&config, MAX_LIVE);
    let mut model = Model {
        config: config.clone(),
        rng: SplitMix64::new(42),
    };

    // Requests: (id, prompt tokens, tokens to generate, samples).
    let mut queue = VecDeque::from([
        (0, 1500, 40, 1),
        (1, 1800, 24, 2),
        (2, 2000, 32, 1),
        (3, 700, 20, 1),
    ]);
    let mut live: Vec<Live> = Vec::new();
    let swap = std::env::temp_dir().join(format!("sjkvarn-serve-{}.sjkv", std::process::id()));
    let mut swapped: Option<(usize, usize, Vec<f32>, Vec<f32>)> = None; // id, left, q, out
    let (mut step, mut generated, mut peak) = (0, 0, 0);

    while !queue.is_empty() || !live.is_empty() || swapped.is_some() {
        // Admit the next request if its samples fit; the samples fork its prefilled prompt.
        let held = live.len() + swapped.is_some() as usize;
        if let Some(&(id, prompt, left, samples)) = queue.front() {
            if held + samples <= MAX_LIVE {
                queue.pop_front();
                let mut seq = Sequence::new(config.clone(), pool.clone())?;
                model.prefill(&mut seq, prompt)?;
                let used = pool.stats().used;
                let forks: Vec<Sequence> = (1..samples).map(|_| seq.fork()).collect();
                assert_eq!(pool.stats().used, used, "a fork allocates no record slots");
                let seqs = forks.into_iter().chain([seq]);
                live.extend(seqs.map(|seq| Live { id, seq, left }));
                println!(
                    "step {step:3}: admit request {id}: {prompt} prompt tokens, {samples} \
                     sample(s), pool {used}"
                );
                continue; // admit the next one before decoding
            }
        }

        // Decode: one step per live sequence, round robin. Request 0 decodes speculatively:
        // DRAFT tokens in one forward, the verifier keeps some, the rest are truncated away.
        for l in live.iter_mut() {
            let len = l.seq.len(0)?;
            let kept = if l.id == 0 {
                model.forward(&mut l.seq, DRAFT)?;
                // The verifier's verdict (a stand-in); a cut in the ring is exact, so the
                // resume point truncate returns is the cut itself: nothing to re-run.
                let kept = (1 + step % DRAFT).min(l.left);
                assert_eq!(l.seq.truncate(len + kept)?, len + kept);
                kept
            } else {
                model.forward(&mut l.seq, 1)?;
                1
            };
            l.left -= kept;
            generated += kept;
        }
        peak = peak.max(pool.stats().used);
        step += 1;

        // Preempt the longest sequence at step 5 (swap it out to a file, freeing its slots) and
        // bring it back at step 10, checking that its attention is bit-identical.
        let longest = (0..live.len()).max_by_key(|&i| live[i].seq.len(0).unwrap_or(0));
        if let (5, Some(i)) = (step, longest) {
            let l = live.swap_remove(i);
            let q = model.rng.gaussians(config.q_heads * config.head_dim);
            let out = attend(&l.seq, 2, &q, None)?;
            l.seq.save(&swap)?;
            let before = pool.stats().used;
            drop(l.seq);
            let bytes = std::fs::metadata(&swap)?.len();
            let after = pool.stats().used;
            println!(
                "step {step:3}: swap out request {}: {bytes} bytes, pool {before} -> {after}",
                l.id
            );
            swapped = Some((l.id, l.left, q, out));
        } else if step == 10 {
            if let Some((id, left, q, out)) = swapped.take() {
                let seq = Sequence::load(&swap, Some(pool.clone()), Some(&config))?;
                std::fs::remove_file(&swap)?;
                assert_eq!(attend(&seq, 2, &q, None)?, out, "restored sequence differs");
                println!("step {step:3}: swap in request {id}, attention identical");
                live.push(Live { id, seq, left });
            }
        }

        // Retire finished sequences: dropping a sequence releases its record slots (a slot
        // shared with a fork stays until the last holder is gone).
        let (done, running): (Vec<Live>, Vec<Live>) = live.into_iter().partition(|l| l.left == 0);
        live = running;
        for l in done {
            let m = l.seq.memory();
            drop(l.seq);
            let (sealed, used) = (m.sealed_tokens / config.layers, pool.stats().used);
            let (id, tokens, bits) = (l.id, m.tokens, m.effective_bits);
            println!(
                "step {step:3}: retire request {id}: {tokens} tokens ({sealed} sealed per layer), \
                 {bits:.2} bits/value, pool {used}"
            );
        }
    }

    // "pool N" above: record slots in use.
    let stats = pool.stats();
    assert_eq!(stats.used, 0, "every slot is back in the pool");
    let (capacity, kib) = (stats.capacity, stats.slot_bytes / 1024);
    println!(
        "summary: {step} decode steps, {generated} tokens generated, pool peak {peak} of \
         {capacity} slots ({kib} KiB each), all freed"
    );
    Ok(())
}
