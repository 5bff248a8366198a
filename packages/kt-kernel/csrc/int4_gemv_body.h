// The INT4 small-row product (format_int4.cpp), included once per ISA inside a
// `#pragma GCC target` region and a namespace that first defines the vector layer `V`:
//   V::F (a vector of V::L fp32), V::kRows (rows per register block), zero, loadu, storeu, fma,
//   set1, hsum (a fixed-order horizontal sum), round_bf16 (to nearest even, kept as fp32) and
//   decode(p, s0, s1, w0, w1): V::L packed bytes at p -> the weights of the two rows of the
//   pair in fp32 (low nibble times s0, high nibble times s1).
// No includes here.
//
// Each output element is one fixed sequence of fp32 FMAs (the order depends only on the shape),
// so results are the same on every thread count; the weights are formed exactly as the tile
// loader forms them (fp32 product, rounded once to bf16 when the compute dtype is bf16).

// nt: out[r0 + r, n] = sum_c x[r, c] * W[n, c] for r < MB, every n. `x` is fp32 [MB, kpad]
// (row stride ldx), zero in the padding columns [k, kpad), so the tail vector adds zeros.
template <int MB, bool Wbf16>
static void nt_block(const Int4Mat& g, const float* x, int64_t ldx, const OutRows& o,
                     int64_t r0) {
  const int64_t pairs = (g.n + 1) / 2;
  const int64_t kfull = g.k / V::L * V::L;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* src = g.packed + p * g.k;
    const c10::BFloat16* s0p = g.scale + 2 * p * g.groups;
    const bool two = 2 * p + 1 < g.n;  // the last pair of an odd N has one row
    typename V::F a0[MB], a1[MB];
    for (int r = 0; r < MB; ++r) a0[r] = a1[r] = V::zero();
    const auto step = [&](const uint8_t* bp, int64_t c) {
      const int64_t grp = c >> g.gshift;
      const float s0 = static_cast<float>(s0p[grp]);
      const float s1 = two ? static_cast<float>(s0p[g.groups + grp]) : 0.0f;
      typename V::F w0, w1;
      V::decode(bp, s0, s1, w0, w1);
      if (Wbf16) {
        w0 = V::round_bf16(w0);
        w1 = V::round_bf16(w1);
      }
#pragma GCC unroll 16
      for (int r = 0; r < MB; ++r) {
        const typename V::F xv = V::loadu(x + r * ldx + c);
        a0[r] = V::fma(w0, xv, a0[r]);
        a1[r] = V::fma(w1, xv, a1[r]);
      }
    };
    for (int64_t c = 0; c < kfull; c += V::L) step(src + c, c);
    if (kfull < g.k) {  // the bytes past K belong to the next row pair (or expert): copy
      uint8_t tail[64];
      std::memset(tail, 8, sizeof(tail));  // 8: weight 0
      std::memcpy(tail, src + kfull, static_cast<size_t>(g.k - kfull));
      step(tail, kfull);
    }
    for (int r = 0; r < MB; ++r) {
      o.put(r0 + r, 2 * p, V::hsum(a0[r]));
      if (two) o.put(r0 + r, 2 * p + 1, V::hsum(a1[r]));
    }
  }
}

// nn: acc[r, c] += sum_n x[r, n] * W[n, c] for r < MB, c < kpad. `x` is fp32 [MB, 2 * pairs]
// (row stride ldx; zero in the column of an odd N's missing row), `acc` fp32 [MB, kpad].
// Row pairs go in blocks of kPairBlock, so a block's strip of packed bytes stays in L1 while
// every column vector of it is done (the rows lie K apart: with K a multiple of 2 KiB a larger
// block maps onto too few L1 sets); acc is read and written once per block.
template <int MB, bool Wbf16>
static void nn_block(const Int4Mat& g, const float* x, int64_t ldx, float* acc, int64_t lda) {
  constexpr int64_t kPairBlock = 16;
  const int64_t pairs = (g.n + 1) / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairBlock) {
    const int64_t p1 = std::min(pairs, p0 + kPairBlock);
    for (int64_t c = 0; c < g.k; c += V::L) {
      const int64_t grp = c >> g.gshift;
      typename V::F a[MB];
      for (int r = 0; r < MB; ++r) a[r] = V::loadu(acc + r * lda + c);
      const auto step = [&](const uint8_t* bp, int64_t p) {
        const c10::BFloat16* s0p = g.scale + 2 * p * g.groups + grp;
        const float s0 = static_cast<float>(*s0p);
        const float s1 = 2 * p + 1 < g.n ? static_cast<float>(s0p[g.groups]) : 0.0f;
        typename V::F w0, w1;
        V::decode(bp, s0, s1, w0, w1);
        if (Wbf16) {
          w0 = V::round_bf16(w0);
          w1 = V::round_bf16(w1);
        }
        const float* xp = x + 2 * p;
#pragma GCC unroll 16
        for (int r = 0; r < MB; ++r) {
          a[r] = V::fma(w0, V::set1(xp[r * ldx]), a[r]);
          a[r] = V::fma(w1, V::set1(xp[r * ldx + 1]), a[r]);
        }
      };
      if (c + V::L <= g.k) {
        for (int64_t p = p0; p < p1; ++p) step(g.packed + p * g.k + c, p);
      } else {  // the bytes past K belong to the next row pair (or expert): copy
        for (int64_t p = p0; p < p1; ++p) {
          uint8_t tail[64];
          std::memset(tail, 8, sizeof(tail));  // 8: weight 0
          std::memcpy(tail, g.packed + p * g.k + c, static_cast<size_t>(g.k - c));
          step(tail, p);
        }
      }
      for (int r = 0; r < MB; ++r) V::storeu(acc + r * lda + c, a[r]);
    }
  }
}

// Rows [0, m) in register blocks of at most V::kRows (for_row_blocks, format_simd.h), the
// weight rounding a template argument too: block.template operator()<R, Wbf16>(r0) per block.
template <typename Block>
static void for_blocks(int64_t m, bool wbf16, const Block& block) {
  for_row_blocks<V::kRows>(m, [&]<int R>(int64_t r0) {
    if (wbf16) {
      block.template operator()<R, true>(r0);
    } else {
      block.template operator()<R, false>(r0);
    }
  });
}

static void nt(const Int4Mat& g, const float* x, int64_t ldx, int64_t m, bool wbf16,
               const OutRows& o) {
  for_blocks(m, wbf16, [&]<int R, bool B>(int64_t r0) {
    nt_block<R, B>(g, x + r0 * ldx, ldx, o, r0);
  });
}

static void nn(const Int4Mat& g, const float* x, int64_t ldx, int64_t m, bool wbf16, float* acc,
               int64_t lda) {
  for_blocks(m, wbf16, [&]<int R, bool B>(int64_t r0) {
    nn_block<R, B>(g, x + r0 * ldx, ldx, acc + r0 * lda, lda);
  });
}
