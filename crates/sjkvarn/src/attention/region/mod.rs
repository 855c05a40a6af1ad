//! The region folds: each reads one kind of region of a layer (dense sink and ring rows,
//! sealed records, the exact window) into the pairs' online softmax states.

pub(super) mod dense;
pub(super) mod record;
pub(super) mod window;
