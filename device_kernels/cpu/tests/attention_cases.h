// The cases attention_kernel_test.cc runs: batched and packed sequences over
// every band shape of the sparse modes, with and without mask, bias and dropout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device_kernels/cpu/tests/attention_problem.h"

namespace jax_rope::cpu::test {

SequenceBand Seq(int32_t q_start, int32_t q_len, int32_t kv_start, int32_t kv_len,
                 int32_t lo_off = -kInf, int32_t hi_off = kInf, int32_t hi_floor = -kInf) {
  return {q_start, q_len, kv_start, kv_len, lo_off, hi_off, hi_floor};
}

Problem Batched(const std::string& name, int64_t b, int64_t sq, int64_t skv, int32_t lo_off,
                int32_t hi_off, int32_t hi_floor = -kInf) {
  Problem p;
  p.name = name;
  p.sq = sq;
  p.skv = skv;
  for (int64_t i = 0; i < b; ++i) p.seqs.push_back(Seq(0, sq, 0, skv, lo_off, hi_off, hi_floor));
  return p;
}

// Packed sequences of the given (q_len, kv_len), each with its own band.
Problem Packed(const std::string& name, const std::vector<SequenceBand>& bands,
              int32_t padding_rows = 3) {
  Problem p;
  p.name = name;
  p.packed = true;
  int32_t qs = 0, ks = 0;
  for (SequenceBand s : bands) {
    s.q_start = qs;
    s.kv_start = ks;
    qs += s.q_len;
    ks += s.kv_len;
    p.seqs.push_back(s);
  }
  p.sq = qs + padding_rows;  // rows beyond the last sequence
  p.skv = ks + padding_rows;
  return p;
}

std::vector<Problem> Cases() {
  std::vector<Problem> cases;
  cases.push_back(Batched("no limit", 2, 100, 90, -kInf, kInf));
  cases.push_back(Batched("causal", 2, 130, 130, -kInf, 0));
  cases.push_back(Batched("causal delta>0", 1, 70, 150, -kInf, 80));
  cases.push_back(Batched("causal delta<0", 1, 150, 70, -kInf, -80));
  cases.push_back(Batched("band", 2, 140, 140, -20, 5));
  cases.push_back(Batched("band negative hi", 1, 150, 130, -40, -7));
  cases.push_back(Batched("band wide lo", 1, 100, 200, 30, 90));
  cases.push_back(Batched("prefix", 2, 130, 150, -kInf, 20, 69));
  cases.push_back(Batched("causal long prefix", 1, 200, 200, -kInf, 0, 140));
  Problem m = Batched("mask per b,n + band", 2, 90, 110, -50, 30);
  m.mask_kind = 1;
  cases.push_back(m);
  m = Batched("mask broadcast", 2, 80, 75, -kInf, kInf);
  m.mask_kind = 2;
  m.mask_density = 0.6;
  cases.push_back(m);
  m = Batched("mask per b causal", 2, 70, 70, -kInf, 0);
  m.mask_kind = 3;
  cases.push_back(m);
  Problem p = Batched("bnsd gqa d=24 dv=16", 2, 77, 83, -kInf, 3);
  p.heads_major = true;
  p.n1 = 4;
  p.n2 = 2;
  p.d = 24;
  p.dv = 16;
  cases.push_back(p);
  p = Batched("d=128 causal", 1, 200, 200, -kInf, 0);
  p.d = p.dv = 128;
  p.n1 = 2;
  p.n2 = 1;
  cases.push_back(p);
  p = Batched("short rows in padded batch", 1, 90, 90, -kInf, 0);
  p.seqs[0].q_len = 61;
  p.seqs[0].kv_len = 70;
  p.dv = 20;
  cases.push_back(p);
  // Packed: empty sequences, kv_len 0, different bands per sequence (modes 7/8).
  p = Packed("packed varlen", {Seq(0, 5, 0, 7, -kInf, 2), Seq(0, 0, 0, 0), Seq(0, 70, 0, 66),
                               Seq(0, 3, 0, 0), Seq(0, 0, 0, 9), Seq(0, 130, 0, 140, -kInf, 10),
                               Seq(0, 9, 0, 12, -12, -2)});
  p.n1 = 4;
  p.n2 = 2;
  p.d = 24;
  p.dv = 8;
  cases.push_back(p);
  p = Packed("packed mask", {Seq(0, 33, 0, 40, -kInf, 7), Seq(0, 66, 0, 66, -kInf, 0),
                             Seq(0, 1, 0, 1)});
  p.mask_kind = 2;
  p.n1 = 2;
  p.n2 = 1;
  p.d = 40;
  p.dv = 40;
  cases.push_back(p);
  p = Packed("packed prefix + band", {Seq(0, 100, 0, 120, -kInf, 20, 49),
                                      Seq(0, 80, 0, 70, -30, 4), Seq(0, 64, 0, 64, -kInf, 0)});
  p.n1 = 3;
  p.n2 = 3;
  p.d = 16;
  p.dv = 16;
  p.scale = -0.3f;  // a negative scale must not flip masked positions
  cases.push_back(p);
  p = Packed("packed unpadded in-place", {Seq(0, 17, 0, 80, -kInf, 63), Seq(0, 64, 0, 64)}, 0);
  p.d = p.dv = 16;  // float32 operands used in place up to the tensors' last element
  cases.push_back(p);
  p = Batched("sharp scores", 1, 96, 96, -kInf, 0);
  p.scale = 40.0f;  // exp underflows for most keys; nothing may turn into NaN
  p.stat_tol = 1e-4;
  p.out_tol = 1e-4;  // seen at 2.5e-5 with other seeds (the scores' rounding x 40)
  cases.push_back(p);
  cases.push_back(Batched("empty band", 1, 50, 50, 5, 2));
  cases.push_back(Batched("all visible via floor", 1, 70, 90, -kInf, -kInf + 5, kInf));

  // Positional bias and dropout.
  p = Batched("pse full type 1 + mask per b,n + band", 2, 90, 110, -50, 30);
  p.mask_kind = 1;
  p.bias = BiasKind::kTensor;
  p.bias_batch = 2;
  cases.push_back(p);
  p = Batched("pse row type 0 causal gqa + dropout key", 2, 130, 130, -kInf, 0);
  p.n1 = 4;
  p.n2 = 2;
  p.bias = BiasKind::kTensor;
  p.bias_rows = false;
  p.after_scale = true;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.8;
  cases.push_back(p);
  p = Batched("pse compressed type 0", 2, 100, 100, -kInf, kInf);
  p.bias = BiasKind::kCompressed;
  p.after_scale = true;
  p.bias_batch = 2;
  cases.push_back(p);
  p = Batched("alibi offsets + dropout mask", 2, 70, 150, -kInf, 80);
  p.bias = BiasKind::kAlibi;
  p.after_scale = true;
  p.bias_batch = 2;
  p.offsets = {3, 5, -7, 2};
  p.dropout = DropoutMode::kMask;
  p.keep_prob = 0.7;
  cases.push_back(p);
  p = Packed("packed pse type 1 + dropout key", {Seq(0, 5, 0, 7, -kInf, 2), Seq(0, 0, 0, 0),
                                                 Seq(0, 70, 0, 66), Seq(0, 3, 0, 0),
                                                 Seq(0, 80, 0, 90, -kInf, 10)});
  p.n1 = 4;
  p.n2 = 2;
  p.d = 24;
  p.dv = 8;
  p.bias = BiasKind::kPacked;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.9;
  p.scale = -0.3f;
  cases.push_back(p);
  p = Packed("packed row pse type 0 + mask + dropout mask",
             {Seq(0, 33, 0, 40, -kInf, 7), Seq(0, 66, 0, 66, -kInf, 0), Seq(0, 1, 0, 1)});
  p.mask_kind = 2;
  p.n2 = 1;
  p.bias = BiasKind::kTensor;
  p.after_scale = true;
  p.dropout = DropoutMode::kMask;
  p.keep_prob = 0.5;
  cases.push_back(p);
  p = Packed("packed alibi sqrt, offsets of row 0 (mode 8)",
             {Seq(0, 20, 0, 30, -kInf, 10), Seq(0, 70, 0, 70, -kInf, 0)});
  p.bias = BiasKind::kAlibiSqrt;
  p.after_scale = true;
  p.offsets = {10, 0, 0, 0};
  cases.push_back(p);
  p = Packed("packed compressed type 1 + dropout key",
             {Seq(0, 40, 0, 40, -kInf, 0), Seq(0, 75, 0, 75, -kInf, 0)});
  p.bias = BiasKind::kCompressed;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.6;
  cases.push_back(p);
  // Short query blocks (the flash-decoding path): head groups of 1 to 8, more
  // than one key chunk (kSplitKeys), dot and GEMM score routines, odd D.
  p = Batched("decode gqa G=4 bottom-right", 2, 1, 2100, -kInf, 2099);
  p.n1 = 8;
  p.n2 = 2;
  p.d = p.dv = 128;
  cases.push_back(p);
  p = Batched("decode G=8 mask + alibi + dropout key", 2, 2, 1500, -kInf, 1498);
  p.n1 = 8;
  p.n2 = 1;
  p.mask_kind = 1;
  p.bias = BiasKind::kAlibi;
  p.after_scale = true;
  p.offsets = {0, 0, 3, -2};
  p.bias_batch = 2;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.9;
  cases.push_back(p);
  // Rows read in memory order: runs of four heads' rows interleaved (BSND) and
  // one head's rows at a time (BNSD), with dot and GEMM scores.
  p = Batched("decode G=4 four kv heads", 2, 1, 1100, -kInf, 1099);
  p.n1 = 16;
  p.n2 = 4;
  p.d = p.dv = 64;
  cases.push_back(p);
  p.name = "decode bnsd G=4 four kv heads";
  p.heads_major = true;
  cases.push_back(p);
  // Float32 products in pieces of kAskRows key rows (attention_split.cc), the
  // last key block's step of 7 rows ending in a shorter piece.
  p = Batched("decode G=4 last step of 7 keys", 2, 1, 1031, -kInf, 1030);
  p.n1 = 8;
  p.n2 = 2;
  p.d = p.dv = 32;
  cases.push_back(p);
  p = Batched("verify bnsd G=4 gemm scores", 1, 8, 1100, -kInf, 1092);
  p.heads_major = true;
  p.n1 = 8;
  p.n2 = 2;
  p.d = p.dv = 32;
  cases.push_back(p);
  p = Batched("verify G=2 gemm scores d=40 dv=24", 1, 20, 1300, -kInf, 1280);
  p.n1 = 4;
  p.n2 = 2;
  p.d = 40;
  p.dv = 24;
  cases.push_back(p);
  p = Batched("decode G=1 band + prefix + pse type 1", 2, 3, 1100, -500, 1097, 10);
  p.n1 = p.n2 = 2;
  p.bias = BiasKind::kTensor;
  cases.push_back(p);
  p = Packed("packed decode G=4 + dropout mask",
             {Seq(0, 1, 0, 1500, -kInf, 1499), Seq(0, 0, 0, 5), Seq(0, 2, 0, 0),
              Seq(0, 3, 0, 40, -kInf, 37), Seq(0, 1, 0, 1030, -kInf, -kInf)});
  p.n1 = 4;
  p.n2 = 1;
  p.d = 64;
  p.dv = 48;
  p.dropout = DropoutMode::kMask;
  p.keep_prob = 0.7;
  cases.push_back(p);
  // With one worker, the forward's items take all 4 query blocks of a head group (16 lanes).
  p = Batched("gqa G=4 one forward item per head group", 2, 200, 230, -kInf, 30);
  p.n1 = 8;
  p.n2 = 2;
  cases.push_back(p);
  // The fused backward's steps of four key blocks: a causal band and a window whose key
  // blocks each see other query blocks, over a full step and a partial one (6 key blocks).
  p = Batched("causal gqa over two key-block steps", 1, 330, 330, -kInf, 0);
  p.n1 = 4;
  p.n2 = 2;
  p.d = p.dv = 16;
  cases.push_back(p);
  p = Batched("window over two key-block steps", 1, 370, 370, -90, 0);
  p.d = p.dv = 16;
  cases.push_back(p);
  return cases;
}

}  // namespace jax_rope::cpu::test
