//! Short parallel calls in which the calling thread works too.
//!
//! A decode call lasts about a millisecond. Handing it whole to the thread pool (a rayon
//! `par_iter` started outside the pool) costs two wake-ups per call: the pool's workers, then
//! the caller when they are done. In a virtual machine waking an idle core costs tens of
//! microseconds, and between a model's attention calls the workers are asleep, so on short
//! calls those wake-ups ate most of the second thread's gain. Here the caller starts on the
//! items at once; pool workers take items from the same counter when they wake, and at the end
//! the caller spins only for the items already taken.
//!
//! At most `rayon::current_num_threads()` participants work at once (the caller holds one
//! seat), but a caller outside the pool wakes every worker for the other seats: measured on a
//! 2-vCPU guest, waking only one let it queue behind the caller on the same core in every
//! other call, while of two woken workers one found the idle core.
//!
//! Which participant runs which item never changes a result: item `i`'s result is stored at
//! `i`, and callers merge them in index order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Counts an item as finished when dropped, so a panicking item cannot leave the caller
/// spinning (the panic itself reaches the caller through the scope).
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// Runs `work(state, i)` for `i in 0..items` on the calling thread and pool workers, at most
/// `rayon::current_num_threads()` at once, and at most `limit` where one is given (`Some(1)`:
/// the caller alone); each participant builds its `state` with `init` once, on its first item.
/// Returns the results in item order.
pub(crate) fn run_items<S, R, I, W>(items: usize, limit: Option<usize>, init: I, work: W) -> Vec<R>
where
    I: Fn() -> S + Sync,
    W: Fn(&mut S, usize) -> R + Sync,
    R: Send,
{
    let next = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<R>>> = (0..items).map(|_| Mutex::new(None)).collect();
    let pool_threads = rayon::current_num_threads();
    let threads = limit.map_or(pool_threads, |l| l.clamp(1, pool_threads));
    let seats = AtomicUsize::new(threads);
    let drain = || {
        if seats
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| s.checked_sub(1))
            .is_err()
        {
            return;
        }
        let mut state = None;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= items {
                break;
            }
            let _finished = Finished(&finished);
            let state = state.get_or_insert_with(&init);
            let result = work(state, i);
            // Each index is taken once, so nobody else holds this cell's lock.
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        }
    };
    // A worker calling from inside the pool is one of its threads already.
    let inside = rayon::current_thread_index().is_some();
    // Outside the pool every worker is woken (see the module doc); a limit below the pool's
    // size wakes only as many as may take a seat.
    let helpers = match (threads, inside) {
        (1, _) => 0,
        (t, true) => t - 1,
        (t, false) if t < pool_threads => t - 1,
        (t, false) => t,
    };
    let helpers = if items > 1 { helpers } else { 0 };
    rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| drain());
        }
        drain();
        // Every item is taken; wait for the ones still running elsewhere.
        while finished.load(Ordering::Acquire) < items {
            std::hint::spin_loop();
        }
    });
    results
        .into_iter()
        .map(|cell| {
            cell.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("every item ran before the scope ended")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_item_order_on_any_pool() {
        for threads in [1, 2, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            // Called from one of the pool's workers; the last call below comes from outside.
            for items in [0, 1, 3, 24, 257] {
                let got = pool.install(|| run_items(items, None, || 0usize, |_, i| i * i));
                let want: Vec<usize> = (0..items).map(|i| i * i).collect();
                assert_eq!(got, want, "{threads} threads, {items} items");
            }
        }
        let got = run_items(10, None, Vec::<usize>::new, |seen, i| {
            seen.push(i);
            i + 1
        });
        assert_eq!(got, (1..=10).collect::<Vec<_>>());
    }

    #[test]
    fn each_participant_builds_its_state_once() {
        let built = AtomicUsize::new(0);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let got = pool
            .install(|| run_items(64, None, || built.fetch_add(1, Ordering::Relaxed), |_, i| i));
        assert_eq!(got, (0..64).collect::<Vec<_>>());
        let built = built.load(Ordering::Relaxed);
        assert!(
            (1..=2).contains(&built),
            "{built} states for 2 participants"
        );
    }

    /// Runs 32 slow items through `run_items` and returns the most that ran at once. With
    /// `company`, item 0 waits (up to 5 s) for a second participant to start an item.
    fn most_at_once(company: bool, limit: Option<usize>) -> usize {
        let (active, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let got = run_items(
            32,
            limit,
            || (),
            |_, i| {
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let start = std::time::Instant::now();
                while company
                    && i == 0
                    && most.load(Ordering::SeqCst) < 2
                    && start.elapsed().as_secs() < 5
                {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
                active.fetch_sub(1, Ordering::SeqCst);
                i
            },
        );
        assert_eq!(got, (0..32).collect::<Vec<_>>());
        most.load(Ordering::SeqCst)
    }

    #[test]
    fn no_more_participants_than_the_pool_has_threads() {
        // From one of a pool's workers ...
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let most = pool.install(|| most_at_once(threads > 1, None));
            assert!(most <= threads, "{most} at once on {threads} threads");
            assert!(
                most >= threads.min(2),
                "{most} at once on {threads} threads"
            );
        }
        // ... and from a thread outside the global pool, as Python calls (other tests share
        // that pool, so whether its workers join in is not asserted).
        let (most, threads) =
            std::thread::spawn(|| (most_at_once(false, None), rayon::current_num_threads()))
                .join()
                .unwrap();
        assert!(most <= threads, "{most} at once on {threads} threads");
    }

    #[test]
    fn a_limit_caps_the_participants() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        // From a worker and from outside any pool: one participant means the caller alone.
        assert_eq!(pool.install(|| most_at_once(false, Some(1))), 1);
        let outside = std::thread::spawn(|| most_at_once(false, Some(1)));
        assert_eq!(outside.join().unwrap(), 1);
        let most = pool.install(|| most_at_once(true, Some(2)));
        assert_eq!(most, 2, "{most} at once with a limit of 2 on 3 threads");
        // A limit above the pool's size is the pool's size; zero is one.
        let most = pool.install(|| most_at_once(true, Some(8)));
        assert!((2..=3).contains(&most), "{most} at once on 3 threads");
        assert_eq!(pool.install(|| most_at_once(false, Some(0))), 1);
    }

    #[test]
    fn a_panicking_item_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                run_items(
                    16,
                    None,
                    || (),
                    |_, i| {
                        assert_ne!(i, 7, "item 7 fails");
                        i
                    },
                )
            })
        }));
        assert!(outcome.is_err());
    }
}
