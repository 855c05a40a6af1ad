//! A record pool shared by many sequences: fixed-size slots, reference counts for forks.
//!
//! A slot holds the records of all KV heads of one layer and one 128-token group. Sealed
//! records are immutable, so a forked sequence shares its parent's slots (copy-on-write never
//! has to copy: nothing is written after a seal). Reservation is all-or-nothing, so a seal that
//! cannot get its slots fails before it changes anything.

use crate::error::{CacheError, CacheResult};
use std::sync::{Arc, Mutex, MutexGuard};

/// Index of a slot in the pool.
pub type SlotId = u32;

/// Slot table, grown on demand up to `capacity`: a pool sized for a long context costs nothing
/// until its slots are used, and growing it can fail with an error instead of aborting.
#[derive(Debug, Default)]
struct Slots {
    capacity: usize,
    data: Vec<Option<Arc<[u8]>>>,
    refs: Vec<u32>,
    /// Released slots, reused before new ones.
    free: Vec<SlotId>,
}

impl Slots {
    fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.data.len())
    }
}

/// Occupancy figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub capacity: usize,
    pub used: usize,
    pub slot_bytes: usize,
}

/// The shared pool; clone the `Arc` to share it.
#[derive(Debug)]
pub struct RecordPool {
    slot_bytes: usize,
    slots: Mutex<Slots>,
}

impl RecordPool {
    /// A pool of up to `capacity` slots (at most `u32::MAX`); slot tables grow as slots are
    /// first used.
    pub fn new(slot_bytes: usize, capacity: usize) -> Arc<Self> {
        let slots = Slots {
            capacity: capacity.min(SlotId::MAX as usize),
            ..Slots::default()
        };
        Arc::new(Self {
            slot_bytes,
            slots: Mutex::new(slots),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic elsewhere cannot leave the slot table inconsistent (every update is a single
        // assignment), so a poisoned lock is still safe to use.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn stats(&self) -> PoolStats {
        let s = self.lock();
        PoolStats {
            capacity: s.capacity,
            used: s.data.len() - s.free.len(),
            slot_bytes: self.slot_bytes,
        }
    }

    /// Reserves `n` slots (reference count 1, empty) or none at all.
    pub fn reserve(&self, n: usize) -> CacheResult<Vec<SlotId>> {
        let mut s = self.lock();
        if s.available() < n {
            return Err(CacheError::PoolExhausted {
                needed: n,
                free: s.available(),
                capacity: s.capacity,
            });
        }
        let reused = n.min(s.free.len());
        let fresh = n - reused;
        let oom = |_| CacheError::OutOfMemory {
            what: "record pool slot table",
            bytes: fresh * (std::mem::size_of::<Option<Arc<[u8]>>>() + 4),
        };
        s.data.try_reserve(fresh).map_err(oom)?;
        s.refs.try_reserve(fresh).map_err(oom)?;
        let at = s.free.len() - reused;
        let mut ids: Vec<SlotId> = s.free.split_off(at);
        for _ in 0..fresh {
            ids.push(s.data.len() as SlotId);
            s.data.push(None);
            s.refs.push(0);
        }
        for &id in &ids {
            s.refs[id as usize] = 1;
        }
        Ok(ids)
    }

    /// Stores a sealed slot's bytes (at most `slot_bytes`).
    pub fn fill(&self, id: SlotId, bytes: Arc<[u8]>) {
        debug_assert!(bytes.len() <= self.slot_bytes);
        self.lock().data[id as usize] = Some(bytes);
    }

    /// The bytes of a filled slot.
    pub fn get(&self, id: SlotId) -> Arc<[u8]> {
        self.lock().data[id as usize]
            .clone()
            .expect("block tables only hold filled slots")
    }

    /// Adds a reference to each slot (a fork shares them).
    pub fn retain(&self, ids: &[SlotId]) {
        let mut s = self.lock();
        for &id in ids {
            s.refs[id as usize] += 1;
        }
    }

    /// Drops a reference to each slot; slots nobody references return to the free list.
    pub fn release(&self, ids: &[SlotId]) {
        let mut s = self.lock();
        for &id in ids {
            let r = &mut s.refs[id as usize];
            *r = r.saturating_sub(1);
            if *r == 0 {
                s.data[id as usize] = None;
                s.free.push(id);
            }
        }
    }

    /// Current reference count of a slot (for tests and accounting).
    pub fn refs(&self, id: SlotId) -> u32 {
        self.lock().refs[id as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_all_or_nothing_and_release_recycles() {
        let pool = RecordPool::new(16, 4);
        let a = pool.reserve(3).unwrap();
        assert!(matches!(
            pool.reserve(2),
            Err(CacheError::PoolExhausted {
                needed: 2,
                free: 1,
                capacity: 4
            })
        ));
        assert_eq!(pool.stats().used, 3);
        pool.retain(&a[..1]);
        pool.release(&a);
        assert_eq!(pool.stats().used, 1);
        assert_eq!(pool.refs(a[0]), 1);
        pool.release(&a[..1]);
        assert_eq!(pool.stats().used, 0);
        assert_eq!(pool.reserve(4).unwrap().len(), 4);
    }
}
