//! LSB-first bit packing: code `i` of width `b` occupies bits `[i*b, (i+1)*b)` of a little-endian
//! bit stream. One rule for every width (2..8) keeps CPU and GPU decoders identical.

/// Bytes needed for `count` codes of `bits` bits.
pub const fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

/// Packs `codes` (each `< 2^bits`) into `out`, which must be `packed_len` bytes long.
pub fn pack(codes: &[u8], bits: u32, out: &mut [u8]) {
    debug_assert_eq!(out.len(), packed_len(codes.len(), bits));
    let mask = (1u64 << bits) - 1;
    let mut acc: u64 = 0;
    let mut filled = 0u32;
    let mut pos = 0;
    for &code in codes {
        acc |= (code as u64 & mask) << filled;
        filled += bits;
        while filled >= 8 {
            out[pos] = acc as u8;
            pos += 1;
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out[pos] = acc as u8;
    }
}

/// Unpacks `out.len()` codes of `bits` bits from `packed`.
pub fn unpack(packed: &[u8], bits: u32, out: &mut [u8]) {
    debug_assert!(packed.len() >= packed_len(out.len(), bits));
    let mask = (1u64 << bits) - 1;
    let mut acc: u64 = 0;
    let mut filled = 0u32;
    let mut pos = 0;
    for code in out.iter_mut() {
        while filled < bits {
            acc |= (packed[pos] as u64) << filled;
            pos += 1;
            filled += 8;
        }
        *code = (acc & mask) as u8;
        acc >>= bits;
        filled -= bits;
    }
}

/// Reads code `index` directly (random access, as a GPU thread would).
#[cfg(test)]
pub fn code_at(packed: &[u8], bits: u32, index: usize) -> u8 {
    let bit = index * bits as usize;
    let byte = bit / 8;
    let shift = bit % 8;
    let mut word = packed[byte] as u16;
    if shift + bits as usize > 8 {
        word |= (packed[byte + 1] as u16) << 8;
    }
    ((word >> shift) & ((1u16 << bits) - 1)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_width() {
        for bits in 1..=8u32 {
            let codes: Vec<u8> = (0..257u32)
                .map(|i| (i.wrapping_mul(2654435761u32) >> 7) as u8 & ((1u16 << bits) - 1) as u8)
                .collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack(&codes, bits, &mut packed);
            let mut back = vec![0u8; codes.len()];
            unpack(&packed, bits, &mut back);
            assert_eq!(back, codes, "bits={bits}");
            for (i, &c) in codes.iter().enumerate() {
                assert_eq!(code_at(&packed, bits, i), c);
            }
        }
    }

    #[test]
    fn layout_is_lsb_first() {
        let mut packed = [0u8; 2];
        pack(&[0b101, 0b011, 0b111], 3, &mut packed[..2]);
        // bits: 101 | 011<<3 | 111<<6 -> 0b11_011_101, then the last bit of 111 in byte 1
        assert_eq!(packed, [0b1101_1101, 0b0000_0001]);
    }
}
