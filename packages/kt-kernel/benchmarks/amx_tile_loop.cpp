// The AMX-BF16 tile loop alone: the ceiling of any product built from it on this CPU.
//
// Usage: amx_tile_loop ROW_TILES STEPS PASSES REPS TRIALS PREFETCH [MODE]
// Each pass multiplies ROW_TILES row tiles of 32 rows (A: 32 x 32*STEPS bf16, K+32 stride as
// the kernel's padded rows) by one pass's B tiles (STEPS pairs of 16 x 64-byte tiles), 2 x 2 C
// tiles per row tile (the arrangement that the 8 tile registers allow), C stored once per row
// tile. PASSES distinct B panels are read in turn, so with enough of them every pass's B comes
// from memory, as an expert's weights do.
// MODE says where B comes from:
// - 0: straight from the panels, already in tile layout (nothing is built);
// - 1: as the kernel's bf16-packed products: a pass's panel is two blocks (1 KiB of each per
//   step); the first row tile loads each step's 2 KiB, shuffles it and stores it into a pass
//   buffer just before multiplying it, and the later row tiles reuse the buffer;
// - 2: mode 1's loads, shuffles and stores without any tile product (the weights' read alone);
// - 3: mode 1's tile products without the build (the pass buffer is never rewritten: the
//   arithmetic alone, on the same loop);
// - 4: mode 3 on AMX-INT8 tiles (TDPBSSD: 64 int8 per tile row, twice the multiply-adds of a
//   bf16 tile product; counted as such, so a step covers 64 of K);
// - 5: mode 1 on AMX-INT8 tiles: an int8 x int8 product building its B tiles from int8
//   weights (the same loads, shuffles and stores as mode 1, but a step's 2 KiB now covers 64
//   of K: half the bytes per multiply-add).
// PREFETCH 1 spreads software prefetches (to L2) of the next pass's B over this pass's row
// tiles and steps; 0 leaves it to the hardware prefetchers.
// Prints the best of TRIALS runs as GFLOP per thread CPU second (CLOCK_THREAD_CPUTIME_ID,
// which other processes' load disturbs least); mode 2 counts the FLOP it would have done.
// Built by bench_amx_ceiling.py with g++.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

__attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw"))) double run(
    int row_tiles, int steps, int passes, int reps, bool prefetch, int mode) {
  const int64_t k = 32LL * steps, lda = (k + 32) * 2;  // bytes per A row
  std::vector<uint16_t> a(static_cast<size_t>(row_tiles) * 32 * lda / 2 + 64, 0x3f80);
  std::vector<uint16_t> b(static_cast<size_t>(passes) * steps * 1024 + 64, 0x3f80);
  std::vector<uint16_t> buf(static_cast<size_t>(steps) * 1024 + 32, 0x3f80);
  uint16_t* pb = buf.data() + (32 - reinterpret_cast<uintptr_t>(buf.data()) / 2 % 32) % 32;
  const __m512i sh = _mm512_set4_epi32(0x0f0e0b0a, 0x0d0c0908, 0x07060302, 0x05040100);
  alignas(64) float c[4][256];
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const bool built = mode != 0, multiply = mode != 2, read = mode == 1 || mode == 2 || mode == 5;
  const bool int8 = mode == 4 || mode == 5;
  const double t0 = thread_seconds();
  for (int rep = 0; rep < reps; ++rep) {
    for (int pass = 0; pass < passes; ++pass) {
      const uint16_t* bt = b.data() + static_cast<size_t>(pass) * steps * 1024;
      // The next pass's 32 lines per step, spread evenly over this pass's row tiles and steps.
      const char* next = reinterpret_cast<const char*>(bt + steps * 1024);
      const int lines = 32 * steps, per = (lines + row_tiles * steps - 1) / (row_tiles * steps);
      for (int m = 0; m < row_tiles; ++m) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const char* a0 = reinterpret_cast<const char*>(a.data()) + m * 32 * lda;
        for (int s = 0; s < steps; ++s) {
          if (prefetch && pass + 1 < passes) {
            for (int l = (m * steps + s) * per, e = l + per; l < e && l < lines; ++l) {
              _mm_prefetch(next + 64 * l, _MM_HINT_T1);
            }
          }
          const uint16_t* b0 = bt + s * 1024;
          if (built) {
            b0 = pb + s * 1024;
            if (m == 0 && read) {
              // Block 0 of the pass holds the first steps * 512 elements, block 1 the rest.
              const uint16_t* s0 = bt + s * 512;
              uint16_t* d = pb + s * 1024;
              for (int r = 0; r < 16; ++r) {
                _mm512_store_si512(d + 32 * r,
                                   _mm512_shuffle_epi8(_mm512_loadu_si512(s0 + 32 * r), sh));
                _mm512_store_si512(
                    d + 512 + 32 * r,
                    _mm512_shuffle_epi8(_mm512_loadu_si512(s0 + steps * 512 + 32 * r), sh));
              }
            }
          }
          if (!multiply) continue;
          _tile_loadd(4, a0 + 64 * s, lda);
          _tile_loadd(5, a0 + 16 * lda + 64 * s, lda);
          _tile_loadd(6, b0, 64);
          _tile_loadd(7, b0 + 512, 64);
          if (int8) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
          } else {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
      }
    }
  }
  const double dt = thread_seconds() - t0;
  _tile_release();
  const double flop = (int8 ? 2.0 : 1.0) * 2.0 * reps * passes * row_tiles * 32.0 * 32.0 *
                      32.0 * steps;
  return flop / dt / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr, "usage: %s ROW_TILES STEPS PASSES REPS TRIALS PREFETCH [MODE]\n",
                 argv[0]);
    return 2;
  }
  // Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::fprintf(stderr, "this process may not use AMX tiles (arch_prctl refused)\n");
    return 3;
  }
  const int row_tiles = std::atoi(argv[1]), steps = std::atoi(argv[2]);
  const int passes = std::atoi(argv[3]), reps = std::atoi(argv[4]), trials = std::atoi(argv[5]);
  const bool prefetch = std::atoi(argv[6]) != 0;
  const int mode = argc == 8 ? std::atoi(argv[7]) : 0;
  if (mode < 0 || mode > 5) {
    std::fprintf(stderr, "MODE must be 0-5, got %d\n", mode);
    return 2;
  }
  double best = 0;
  for (int t = 0; t < trials; ++t) {
    const double v = run(row_tiles, steps, passes, reps, prefetch, mode);
    best = v > best ? v : best;
  }
  std::printf("%.1f\n", best);
  return 0;
}
