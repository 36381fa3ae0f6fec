// The float32 <-> bfloat16/float16 conversions of float_convert.h against
// references that decide by value in double precision (the nearer of the two
// neighbouring 16-bit values, ties to the even one, overflow to inf, NaN made
// quiet with its sign and upper payload bits), on every 16-bit pattern and on
// float32 inputs around each rounding boundary; then the same conversions as
// the RoPE kernels run them (the clone this CPU picks, vectorised; float16 with
// F16C and without), on rows with NaN, inf, overflow and ties, the forward's
// outputs stored as usual and streamed (RopeForwardArgs::stream_outputs, rows
// at every alignment; float32 streamed: the same bits as stored). Built and
// run by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/float_convert.h"
#include "device_kernels/cpu/rope_kernels.h"

namespace {

using namespace jax_rope;
using namespace jax_rope::cpu;

int g_failures = 0;
int64_t g_checks = 0;

void Fail(const std::string& what) {
  if (++g_failures <= 30) std::printf("FAIL: %s\n", what.c_str());
}

// Magnitudes (bits without the sign) of the 16-bit formats as doubles; the
// first pattern past the largest finite one stands for the next power of two,
// so that rounding to it means overflow.
double Bf16Magnitude(uint32_t m) {
  if (m >= 0x7f80u) return std::ldexp(1.0, 128);
  const uint32_t e = m >> 7, f = m & 0x7fu;
  return e == 0 ? std::ldexp(double(f), -133) : std::ldexp(double(128 + f), int(e) - 134);
}

double F16Magnitude(uint32_t m) {
  if (m >= 0x7c00u) return 65536.0;
  const uint32_t e = m >> 10, f = m & 0x3ffu;
  return e == 0 ? std::ldexp(double(f), -24) : std::ldexp(double(1024 + f), int(e) - 25);
}

// The 16-bit pattern nearest to f by value: the largest magnitude not above |f|
// (binary search: magnitudes grow with the pattern) or the next one.
uint16_t NearestPattern(float f, double (*magnitude)(uint32_t), uint32_t inf_bits) {
  const double a = std::fabs(double(f));
  uint32_t lo = 0, hi = inf_bits;  // magnitude(lo) <= a < magnitude(hi + 1) holds below
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (magnitude(mid) <= a) lo = mid; else hi = mid - 1;
  }
  uint32_t m = lo;
  if (m < inf_bits) {
    const double below = a - magnitude(m), above = magnitude(m + 1) - a;
    if (above < below || (above == below && (m & 1u))) ++m;
  }
  return static_cast<uint16_t>(m | (std::signbit(f) ? 0x8000u : 0u));
}

uint16_t ReferenceBf16(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>((FloatBits(f) >> 16) | 0x40u);
  return NearestPattern(f, Bf16Magnitude, 0x7f80u);
}

uint16_t ReferenceF16(float f) {
  if (std::isnan(f)) {
    const uint32_t quiet = std::signbit(f) ? 0xfe00u : 0x7e00u;
    return static_cast<uint16_t>(quiet | ((FloatBits(f) >> 13) & 0x3ffu));
  }
  return NearestPattern(f, F16Magnitude, 0x7c00u);
}

bool SameFloat(float a, float b) {
  return std::isnan(a) ? std::isnan(b) : FloatBits(a) == FloatBits(b);
}

void CheckWidening() {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint32_t m = h & 0x7fffu;
    const double sign = (h & 0x8000u) ? -1.0 : 1.0;
    const float bf = ToFloat(BFloat16{static_cast<uint16_t>(h)});
    const float hf = ToFloat(Float16{static_cast<uint16_t>(h)});
    const float want_bf =
        m > 0x7f80u ? NAN : float(sign * (m == 0x7f80u ? INFINITY : Bf16Magnitude(m)));
    const float want_hf =
        m > 0x7c00u ? NAN : float(sign * (m == 0x7c00u ? INFINITY : F16Magnitude(m)));
    g_checks += 2;
    if (!SameFloat(bf, want_bf) || (!std::isnan(bf) && std::signbit(bf) != (sign < 0)))
      Fail("ToFloat(BFloat16 " + std::to_string(h) + ")");
    if (!SameFloat(hf, want_hf) || (!std::isnan(hf) && std::signbit(hf) != (sign < 0)))
      Fail("ToFloat(Float16 " + std::to_string(h) + ")");
  }
}

// Every upper half-word with low halves at and around the rounding points of
// both formats (bfloat16 drops 16 bits, float16 normals 13) and two random ones.
void CheckNarrowing() {
  std::mt19937 rng(11);
  const uint32_t fixed[] = {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x3000u,
                            0x7fffu, 0x8000u, 0x8001u, 0xefffu, 0xffffu};
  std::vector<float> row;
  for (uint32_t upper = 0; upper < 0x10000u; ++upper) {
    row.clear();
    for (uint32_t low : fixed) row.push_back(BitsFloat(upper << 16 | low));
    row.push_back(BitsFloat(upper << 16 | (rng() & 0xffffu)));
    row.push_back(BitsFloat(upper << 16 | (rng() & 0xffffu)));
    for (float f : row) {
      const uint16_t bf = FromFloat<BFloat16>(f).bits, hf = FromFloat<Float16>(f).bits;
      g_checks += 2;
      if (bf != ReferenceBf16(f))
        Fail("FromFloat<BFloat16>(bits " + std::to_string(FloatBits(f)) + ") = " +
             std::to_string(bf) + ", want " + std::to_string(ReferenceBf16(f)));
      if (hf != ReferenceF16(f))
        Fail("FromFloat<Float16>(bits " + std::to_string(FloatBits(f)) + ") = " +
             std::to_string(hf) + ", want " + std::to_string(ReferenceF16(f)));
    }
  }
}

// The RoPE forward (whichever clone this CPU runs) stores each rotated float32
// value rounded once: x1 c - x2 s and x2 c + x1 s for half, the same per pair
// for interleave. Inputs are 16-bit values, so the products are exact in
// float32 and the expected bits follow from the reference of one rounding.
template <typename T>
void CheckRopeRounding(int32_t mode, bool in_place, bool stream, uint16_t (*reference)(float),
                       int64_t dim) {
  const int64_t batch = 2, seq = 5, heads = 3;
  RopeGeometry g;
  const std::vector<int64_t> q{batch, seq, heads, dim}, c{1, seq, 1, dim};
  const std::string err =
      MakeRopeGeometry(static_cast<int32_t>(Layout::kBSND), mode, q, q, c, c, &g);
  if (!err.empty()) return Fail("geometry: " + err);
  std::mt19937 rng(static_cast<uint32_t>(mode * 2 + in_place + dim * 8));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const float specials[] = {NAN,     -NAN,     INFINITY, -INFINITY, 3.0e38f,
                            -3.0e38f, 1.0e-40f, 0.0f,     -0.0f};
  auto draw = [&](std::vector<T>& v, bool special) {
    for (T& x : v) {
      const int pick = static_cast<int>(rng() % 64);
      x = FromFloat<T>(special && pick < 9 ? specials[pick] : u(rng));
    }
  };
  std::vector<T> query(batch * seq * heads * dim), key(query.size());
  std::vector<T> cos(seq * dim), sin(seq * dim);
  draw(query, true);
  draw(key, true);
  draw(cos, false);
  draw(sin, false);
  std::vector<T> query_out(query.size()), key_out(key.size());
  const std::vector<T> query_in = query, key_in = key;
  RopeForwardArgs<T> args{query.data(), key.data(), cos.data(), sin.data(),
                          in_place ? query.data() : query_out.data(),
                          in_place ? key.data() : key_out.data(), stream};
  RopeForward<T>(g, args, 0, g.tokens());
  const std::vector<T>& got_q = in_place ? query : query_out;
  const std::vector<T>& got_k = in_place ? key : key_out;
  const int64_t h = dim / 2;
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<T>& in = pass ? key_in : query_in;
    const std::vector<T>& got = pass ? got_k : got_q;
    for (int64_t row = 0; row < batch * seq * heads; ++row) {
      const int64_t pos = (row / heads) % seq;
      const T* x = in.data() + row * dim;
      const T* cr = cos.data() + pos * dim;
      const T* sr = sin.data() + pos * dim;
      for (int64_t i = 0; i < dim; ++i) {
        // partner j and the sign of its product, per spec/rope.md (quarter: a
        // half rotation on each half of the row)
        int64_t j;
        float sign;
        if (mode == static_cast<int32_t>(RotaryMode::kInterleave)) {
          j = i ^ 1;
          sign = (i & 1) ? 1.0f : -1.0f;
        } else {
          const bool quarter = mode == static_cast<int32_t>(RotaryMode::kQuarter);
          const int64_t width = quarter ? h / 2 : h;
          const int64_t block = quarter && i >= h ? h : 0, local = i - block;
          j = block + (local < width ? local + width : local - width);
          sign = local < width ? -1.0f : 1.0f;
        }
        const float direct = ToFloat(x[i]) * ToFloat(cr[i]);
        const float rotated = ToFloat(x[j]) * ToFloat(sr[i]);
        const float exact = sign < 0 ? direct - rotated : direct + rotated;
        // A NaN's payload and sign depend on operand order, which the compiler
        // may swap in a sum: any quiet NaN will do.
        const uint16_t want = reference(exact), bits = got[row * dim + i].bits;
        const uint16_t quiet_nan = reference(NAN) & 0x7fffu;
        ++g_checks;
        if (std::isnan(exact) ? (bits & quiet_nan) != quiet_nan : bits != want)
          Fail(std::string(in_place ? "in place " : "") + (stream ? "streamed " : "") + "mode " +
               std::to_string(mode) +
               " row " + std::to_string(row) + " element " + std::to_string(i) + ": " +
               std::to_string(bits) + ", want " + std::to_string(want));
      }
    }
  }
}

// The float32 forward (and in half mode the backward's dx) streamed
// (stream_outputs) into outputs starting `shift` elements past an aligned
// address, rotating `rotary` of each row's `dim` elements: the bits of the
// stored results, whose values the Python tests hold to the float64 oracle.
void CheckRopeStreamedFloat(int32_t mode, int64_t dim, int64_t rotary, int64_t shift) {
  const int64_t batch = 2, seq = 3, heads = 5;
  RopeGeometry g;
  const std::vector<int64_t> q{batch, seq, heads, dim}, k{batch, seq, 2, dim};
  const std::vector<int64_t> c{1, seq, 1, rotary};
  const std::string err =
      MakeRopeGeometry(static_cast<int32_t>(Layout::kBSND), mode, q, k, c, c, &g);
  if (!err.empty()) return Fail("geometry: " + err);
  std::mt19937 rng(static_cast<uint32_t>(mode * 31 + dim + rotary + shift));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> query(batch * seq * heads * dim), key(batch * seq * 2 * dim);
  std::vector<float> cos(seq * rotary), sin(seq * rotary);
  for (auto* v : {&query, &key, &cos, &sin}) {
    for (float& x : *v) x = u(rng);
  }
  std::vector<float> stored_q(query.size()), stored_k(key.size());
  std::vector<float> streamed_q(query.size() + 8), streamed_k(key.size() + 8);
  RopeForward<float>(g, {query.data(), key.data(), cos.data(), sin.data(), stored_q.data(),
                         stored_k.data(), false}, 0, g.tokens());
  RopeForward<float>(g, {query.data(), key.data(), cos.data(), sin.data(),
                         streamed_q.data() + shift, streamed_k.data() + shift, true},
                     0, g.tokens());
  const auto same_bits = [&](const char* what) {
    for (int pass = 0; pass < 2; ++pass) {
      const std::vector<float>& want = pass ? stored_k : stored_q;
      const float* got = (pass ? streamed_k : streamed_q).data() + shift;
      for (size_t i = 0; i < want.size(); ++i, ++g_checks) {
        if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
          Fail(std::string("float32 streamed ") + what + ", mode " + std::to_string(mode) +
               " dim " + std::to_string(dim) + " rotary " + std::to_string(rotary) + " shift " +
               std::to_string(shift) + ": element " + std::to_string(i) + " differs");
          break;
        }
      }
    }
  };
  same_bits("forward");
  if (mode != static_cast<int32_t>(RotaryMode::kHalf)) return;
  const std::vector<float> grad_q = stored_q, grad_k = stored_k;  // the forward's outputs
  for (bool stream : {false, true}) {
    RopeBackwardArgs<float> args{grad_q.data(), grad_k.data(), cos.data(), sin.data(),
                                 nullptr,       nullptr,
                                 stream ? streamed_q.data() + shift : stored_q.data(),
                                 stream ? streamed_k.data() + shift : stored_k.data(),
                                 nullptr,       nullptr};
    args.stream_outputs = stream;
    RopeBackward<float>(g, args, 0, g.tokens());
  }
  same_bits("backward");
}

// The backward's dx (half mode): c g1 + s' g2 and c' g2 - s g1 per pair (s' and
// c' from the pair's other half), one rounding, with and without the forward
// inputs (which only add the dcos/dsin sums: checked against the float64
// oracle by the Python tests).
template <typename T>
void CheckRopeBackwardRounding(bool with_inputs, bool in_place, bool stream,
                               uint16_t (*reference)(float), int64_t dim) {
  const int64_t batch = 1, seq = 4, heads = 2;
  RopeGeometry g;
  const std::vector<int64_t> q{batch, seq, heads, dim}, c{1, seq, 1, dim};
  const std::string err = MakeRopeGeometry(static_cast<int32_t>(Layout::kBSND),
                                           static_cast<int32_t>(RotaryMode::kHalf), q, q, c, c, &g);
  if (!err.empty()) return Fail("geometry: " + err);
  std::mt19937 rng(static_cast<uint32_t>(7 + with_inputs * 2 + in_place + dim * 8));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  auto draw = [&](std::vector<T>& v) {
    for (T& x : v) x = FromFloat<T>(rng() % 50 == 0 ? NAN : u(rng));
  };
  const size_t n = batch * seq * heads * dim;
  std::vector<T> grad_q(n), grad_k(n), query(n), key(n), cos(seq * dim), sin(seq * dim);
  for (auto* v : {&grad_q, &grad_k, &query, &key, &cos, &sin}) draw(*v);
  const std::vector<T> grad_in = grad_q;
  std::vector<T> dq(n), dk(n), dcos(cos.size()), dsin(sin.size());
  RopeBackwardArgs<T> args{grad_q.data(), grad_k.data(), cos.data(), sin.data(),
                           with_inputs ? query.data() : nullptr,
                           with_inputs ? key.data() : nullptr,
                           in_place ? grad_q.data() : dq.data(), dk.data(),
                           with_inputs ? dcos.data() : nullptr,
                           with_inputs ? dsin.data() : nullptr};
  args.stream_outputs = stream;
  RopeBackward<T>(g, args, 0, g.tokens());
  const std::vector<T>& got = in_place ? grad_q : dq;
  const int64_t h = dim / 2;
  const uint16_t quiet_nan = reference(NAN) & 0x7fffu;
  for (int64_t row = 0; row < batch * seq * heads; ++row) {
    const int64_t pos = row / heads;
    const T* gr = grad_in.data() + row * dim;
    const T* cr = cos.data() + pos * dim;
    const T* sr = sin.data() + pos * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const int64_t j = i < h ? i + h : i - h;
      const float direct = ToFloat(cr[i]) * ToFloat(gr[i]);
      const float rotated = ToFloat(sr[j]) * ToFloat(gr[j]);
      const float exact = i < h ? direct + rotated : direct - rotated;
      const uint16_t want = reference(exact), bits = got[row * dim + i].bits;
      ++g_checks;
      if (std::isnan(exact) ? (bits & quiet_nan) != quiet_nan : bits != want)
        Fail(std::string("backward") + (with_inputs ? " with inputs" : "") +
             (in_place ? " in place" : "") + (stream ? " streamed" : "") + " row " +
             std::to_string(row) + " element " + std::to_string(i) + ": " +
             std::to_string(bits) + ", want " + std::to_string(want));
    }
  }
}

}  // namespace

int main() {
  CheckWidening();
  CheckNarrowing();
  // float16 twice: with F16C's conversions where this CPU has them, then with
  // the portable ones that CPUs without F16C run.
  for (bool f16c : {true, false}) {
    UseF16cForTesting(f16c);
    // Rows ending in a partial vector (52: pairs of 26 and 13; 44: 22), and
    // rows shorter than one (12: pairs of 6 and 3).
    // Streamed in place: stored as usual (the kernel streams fresh outputs only).
    for (bool in_place : {false, true}) {
      for (bool stream : {false, true}) {
        for (int64_t dim : {52, 12}) {
          for (RotaryMode mode :
               {RotaryMode::kHalf, RotaryMode::kQuarter, RotaryMode::kInterleave}) {
            const int32_t m = static_cast<int32_t>(mode);
            if (f16c) CheckRopeRounding<BFloat16>(m, in_place, stream, ReferenceBf16, dim);
            CheckRopeRounding<Float16>(m, in_place, stream, ReferenceF16, dim);
          }
        }
      }
      for (int64_t dim : {44, 12}) {
        for (bool with_inputs : {false, true}) {
          for (bool stream : {false, true}) {
            if (f16c) {
              CheckRopeBackwardRounding<BFloat16>(with_inputs, in_place, stream, ReferenceBf16,
                                                  dim);
            }
            CheckRopeBackwardRounding<Float16>(with_inputs, in_place, stream, ReferenceF16, dim);
          }
        }
      }
    }
  }
  UseF16cForTesting(true);
  for (RotaryMode mode : {RotaryMode::kHalf, RotaryMode::kQuarter, RotaryMode::kInterleave}) {
    for (int64_t dim : {128, 52, 12}) {
      for (int64_t rotary : {dim, dim / 8 * 4}) {  // all of the row, and about half
        for (int64_t shift : {0, 1, 3}) {
          CheckRopeStreamedFloat(static_cast<int32_t>(mode), dim, rotary, shift);
        }
      }
    }
  }
  std::printf("float_convert_test: %lld checks, %d failures\n", static_cast<long long>(g_checks),
              g_failures);
  return g_failures == 0 ? 0 : 1;
}
