//! IEEE binary16 conversion with the reference's rounding: round to nearest even, subnormals
//! kept, overflow to infinity, NaN stored as the quiet pattern `0x7E00` with the input's sign.
//! Every stored scale goes through here, so the record bytes do not depend on the platform.

/// `f32` to fp16 bits, rounded to nearest even.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    if x.is_nan() {
        return ((x.to_bits() >> 16) as u16 & 0x8000) | 0x7e00;
    }
    half::f16::from_f32(x).to_bits()
}

/// fp16 bits to `f32` (exact).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_reference_rules() {
        // Ties to even: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10.
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds up past the largest finite half
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(5.960_464_5e-8), 0x0001); // smallest subnormal
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert_eq!(f32_to_f16(f32::NAN), 0x7e00);
        assert_eq!(f32_to_f16(-f32::NAN), 0xfe00);
        for h in 0..=0xffffu16 {
            let x = f16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f32_to_f16(x), h, "round trip of {h:#06x}");
            }
        }
    }
}
