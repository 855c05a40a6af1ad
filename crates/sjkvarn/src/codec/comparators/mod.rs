//! Block formats sjkvarn is measured against, byte for byte as their own references write them:
//! llama.cpp's `q8_0`/`q4_0`/`q4_1`/`q5_0`/`q5_1` ([`ggml`]) and the rotated norm-coded
//! `turbo3`/`turbo4`/`tq5_0` family ([`tq`]). [`super::format`](mod@super::format) reaches them by name.

pub mod ggml;
pub mod tq;
