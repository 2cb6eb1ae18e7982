// bf16 and fp8 (E4M3) scalar conversions, round-to-nearest-even, as the tensor cores and cvt do.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace pounce::reference {

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16_bits(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);  // quiet NaN
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

inline float round_bf16(float value) {
  return bf16_bits_to_float(float_to_bf16_bits(value));
}

// `count` bf16 values as doubles (exact): how bf16 tensors enter the reference.
inline std::vector<double> bf16_to_double(const uint16_t* bits, size_t count) {
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = bf16_bits_to_float(bits[i]);
  return out;
}
inline std::vector<double> bf16_to_double(const std::vector<uint16_t>& bits) {
  return bf16_to_double(bits.data(), bits.size());
}

// E4M3 (fn): bias 7, max 448, no infinities; saturating round-to-nearest-even.
uint8_t float_to_e4m3(float value);
float e4m3_to_float(uint8_t bits);

}  // namespace pounce::reference
