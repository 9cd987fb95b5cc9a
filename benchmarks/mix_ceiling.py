"""What the multi-row tiles' instruction mix can reach on this CPU: int8 multiply-adds per second of loops that do
nothing but the tiles' inner work, on one thread and on all threads at once (AVX2 loops, and the AVX-512 VNNI
loops where the CPU has VNNI).

    python benchmarks/mix_ceiling.py [--seconds 1.0] [--avx2-only]

A row of an AVX2 tile (quant_linear.cpp) spends per group of four inputs one VPBROADCASTD of its activation codes,
one VPMADDUBSW (32 multiply-adds: 8 outputs x 4 inputs) and one VPADDW into its int16 run; the widening, the fp32
tail and the weight decoding come on top. The loops (inline assembly, register operands where the tiles have them,
no other work):

    maddubs              VPMADDUBSW alone, 8 independent chains (what `--step-costs` reads as the int8 peak)
    maddubs+add          VPMADDUBSW then VPADDW into 8 accumulators
    broadcast+maddubs+add  the same with each product's codes broadcast from memory, as every tile row does
    shared-broadcast     each broadcast feeding two products (both output halves of a block, as a tile of both
                         halves at once would)
    shuffle+maddubs+add  the codes picked out of a register with VPSHUFD instead of a broadcast from memory

A row of an AVX-512 tile spends per block of 32 inputs eight VPDPBUSD (64 multiply-adds each: 16 outputs x 4
inputs), each with its codes as an embedded broadcast, then its fp32 tail: the zero-point term subtracted
(VPSUBD, broadcast), converted (VCVTDQ2PS), times the block's scales (VMULPS) and added times the row's dx
(VFMADD231PS, broadcast). The loops run 8 rows, as the tile does, so 8 chains overlap:

    vnni                 VPDPBUSD alone, register operands
    vnni+broadcast       with each row's codes as an embedded broadcast
    vnni+broadcast+tail  and each row's fp32 tail once per 8 VPDPBUSD

These bound what the tiles can reach from above. For scale, the last line prints the rate a 1B-shaped model's
8-token forward (~9.9 G multiply-adds) needs to take at most 1.3x its one-token step.
"""

from __future__ import annotations

import argparse
import tempfile
from types import SimpleNamespace

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace {

constexpr int kMacsPerRound = 8 * 32;  // 8 VPMADDUBSW of 32 multiply-adds
constexpr int kVnniMacsPerRound = 8 * 8 * 64;  // 8 rows x 8 VPDPBUSD of 64 multiply-adds
#define YMM_CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
    "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory"
alignas(64) int32_t codes[64 * 8];

void maddubs(int64_t rounds) {
  for (int64_t r = 0; r < rounds; ++r)
    asm volatile(
        "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n vpmaddubsw %%ymm15, %%ymm1, %%ymm1\n"
        "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n vpmaddubsw %%ymm15, %%ymm3, %%ymm3\n"
        "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n vpmaddubsw %%ymm15, %%ymm5, %%ymm5\n"
        "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n vpmaddubsw %%ymm15, %%ymm7, %%ymm7\n" ::: YMM_CLOBBERS);
}

void maddubs_add(int64_t rounds) {
  for (int64_t r = 0; r < rounds; ++r)
    asm volatile(
        "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpaddw %%ymm0, %%ymm8, %%ymm8\n"
        "vpmaddubsw %%ymm13, %%ymm15, %%ymm1\n vpaddw %%ymm1, %%ymm9, %%ymm9\n"
        "vpmaddubsw %%ymm14, %%ymm12, %%ymm2\n vpaddw %%ymm2, %%ymm10, %%ymm10\n"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm3\n vpaddw %%ymm3, %%ymm11, %%ymm11\n"
        "vpmaddubsw %%ymm14, %%ymm15, %%ymm4\n vpaddw %%ymm4, %%ymm8, %%ymm8\n"
        "vpmaddubsw %%ymm13, %%ymm15, %%ymm5\n vpaddw %%ymm5, %%ymm9, %%ymm9\n"
        "vpmaddubsw %%ymm14, %%ymm12, %%ymm6\n vpaddw %%ymm6, %%ymm10, %%ymm10\n"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm7\n vpaddw %%ymm7, %%ymm11, %%ymm11\n" ::: YMM_CLOBBERS);
}

void broadcast_maddubs_add(int64_t rounds) {
  for (int64_t r = 0; r < rounds; ++r)
    asm volatile(
        "vpbroadcastd (%0), %%ymm0\n vpmaddubsw %%ymm0, %%ymm15, %%ymm0\n vpaddw %%ymm0, %%ymm8, %%ymm8\n"
        "vpbroadcastd 4(%0), %%ymm1\n vpmaddubsw %%ymm1, %%ymm14, %%ymm1\n vpaddw %%ymm1, %%ymm9, %%ymm9\n"
        "vpbroadcastd 8(%0), %%ymm2\n vpmaddubsw %%ymm2, %%ymm13, %%ymm2\n vpaddw %%ymm2, %%ymm10, %%ymm10\n"
        "vpbroadcastd 12(%0), %%ymm3\n vpmaddubsw %%ymm3, %%ymm12, %%ymm3\n vpaddw %%ymm3, %%ymm11, %%ymm11\n"
        "vpbroadcastd 16(%0), %%ymm4\n vpmaddubsw %%ymm4, %%ymm15, %%ymm4\n vpaddw %%ymm4, %%ymm8, %%ymm8\n"
        "vpbroadcastd 20(%0), %%ymm5\n vpmaddubsw %%ymm5, %%ymm14, %%ymm5\n vpaddw %%ymm5, %%ymm9, %%ymm9\n"
        "vpbroadcastd 24(%0), %%ymm6\n vpmaddubsw %%ymm6, %%ymm13, %%ymm6\n vpaddw %%ymm6, %%ymm10, %%ymm10\n"
        "vpbroadcastd 28(%0), %%ymm7\n vpmaddubsw %%ymm7, %%ymm12, %%ymm7\n vpaddw %%ymm7, %%ymm11, %%ymm11\n"
        :: "r"(codes + (r & 63) * 8) : YMM_CLOBBERS);
}

// Both output halves of a block (two weight registers) take each broadcast: 4 broadcasts per 8 products.
void shared_broadcast(int64_t rounds) {
  for (int64_t r = 0; r < rounds; ++r)
    asm volatile(
        "vpbroadcastd (%0), %%ymm0\n vpmaddubsw %%ymm0, %%ymm15, %%ymm1\n vpmaddubsw %%ymm0, %%ymm14, %%ymm2\n"
        "vpaddw %%ymm1, %%ymm8, %%ymm8\n vpaddw %%ymm2, %%ymm9, %%ymm9\n"
        "vpbroadcastd 4(%0), %%ymm3\n vpmaddubsw %%ymm3, %%ymm13, %%ymm4\n vpmaddubsw %%ymm3, %%ymm12, %%ymm5\n"
        "vpaddw %%ymm4, %%ymm10, %%ymm10\n vpaddw %%ymm5, %%ymm11, %%ymm11\n"
        "vpbroadcastd 8(%0), %%ymm0\n vpmaddubsw %%ymm0, %%ymm15, %%ymm1\n vpmaddubsw %%ymm0, %%ymm14, %%ymm2\n"
        "vpaddw %%ymm1, %%ymm8, %%ymm8\n vpaddw %%ymm2, %%ymm9, %%ymm9\n"
        "vpbroadcastd 12(%0), %%ymm3\n vpmaddubsw %%ymm3, %%ymm13, %%ymm4\n vpmaddubsw %%ymm3, %%ymm12, %%ymm5\n"
        "vpaddw %%ymm4, %%ymm10, %%ymm10\n vpaddw %%ymm5, %%ymm11, %%ymm11\n"
        :: "r"(codes + (r & 63) * 8) : YMM_CLOBBERS);
}

// The codes picked out of a register with VPSHUFD (one in-lane dword each) instead of broadcast from memory.
void shuffle_maddubs_add(int64_t rounds) {
  for (int64_t r = 0; r < rounds; ++r)
    asm volatile(
        "vpshufd $0x00, %%ymm7, %%ymm0\n vpmaddubsw %%ymm0, %%ymm15, %%ymm0\n vpaddw %%ymm0, %%ymm8, %%ymm8\n"
        "vpshufd $0x55, %%ymm7, %%ymm1\n vpmaddubsw %%ymm1, %%ymm14, %%ymm1\n vpaddw %%ymm1, %%ymm9, %%ymm9\n"
        "vpshufd $0xaa, %%ymm7, %%ymm2\n vpmaddubsw %%ymm2, %%ymm13, %%ymm2\n vpaddw %%ymm2, %%ymm10, %%ymm10\n"
        "vpshufd $0xff, %%ymm7, %%ymm3\n vpmaddubsw %%ymm3, %%ymm12, %%ymm3\n vpaddw %%ymm3, %%ymm11, %%ymm11\n"
        "vpshufd $0x00, %%ymm6, %%ymm4\n vpmaddubsw %%ymm4, %%ymm15, %%ymm4\n vpaddw %%ymm4, %%ymm8, %%ymm8\n"
        "vpshufd $0x55, %%ymm6, %%ymm5\n vpmaddubsw %%ymm5, %%ymm14, %%ymm5\n vpaddw %%ymm5, %%ymm9, %%ymm9\n"
        "vpshufd $0xaa, %%ymm6, %%ymm0\n vpmaddubsw %%ymm0, %%ymm13, %%ymm0\n vpaddw %%ymm0, %%ymm10, %%ymm10\n"
        "vpshufd $0xff, %%ymm6, %%ymm1\n vpmaddubsw %%ymm1, %%ymm12, %%ymm1\n vpaddw %%ymm1, %%ymm11, %%ymm11\n"
        ::: YMM_CLOBBERS);
}

VNNI_LOOPS

// Multiply-adds per second of `loop` on `threads` threads started together (the best of a few runs).
double rate(const std::string& name, int64_t threads, double seconds) {
  void (*loop)(int64_t) = name == "maddubs" ? maddubs : name == "maddubs+add" ? maddubs_add
      : name == "broadcast+maddubs+add" ? broadcast_maddubs_add : name == "shared-broadcast" ? shared_broadcast
      : name == "shuffle+maddubs+add" ? shuffle_maddubs_add : VNNI_CHOICE nullptr;
  TORCH_CHECK(loop != nullptr, "unknown loop ", name);
  const int64_t macs_per_round = name.rfind("vnni", 0) == 0 ? kVnniMacsPerRound : kMacsPerRound;
  const int64_t rounds = 1 << 20;
  double best = 0.0;
  for (auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
       std::chrono::steady_clock::now() < until;) {
    std::atomic<int64_t> ready{0};
    std::vector<std::thread> pool;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t t = 0; t < threads; ++t)
      pool.emplace_back([&] {
        ready.fetch_add(1);
        while (ready.load() < threads) {
        }
        loop(rounds);
      });
    for (auto& thread : pool) thread.join();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, double(threads) * rounds * macs_per_round / elapsed);
  }
  return best;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rate", &rate, "int8 multiply-adds per second of one of the loops on `threads` threads at once");
}
"""

LOOPS = ("maddubs", "maddubs+add", "broadcast+maddubs+add", "shared-broadcast", "shuffle+maddubs+add")
VNNI = ("vnni", "vnni+broadcast", "vnni+broadcast+tail")
ROWS = 8  # a VNNI round: 8 rows x 8 groups, zmm0-7 the rows' sums, zmm8-15 the groups' codes, zmm16-23 fp32 sums


def vnni_round(broadcast: bool, tail: bool) -> str:
    """One round's assembly: each row's 8 VPDPBUSD (group by group, rows interleaved as the tile does), then each
    row's fp32 tail; %0 points at the rows' codes ([group][row] int32) and terms."""
    lines = []
    for group in range(8):
        for row in range(ROWS):
            codes = f"{4 * (group * ROWS + row)}(%0)%{{1to16%}}" if broadcast else "%%zmm24"
            lines.append(f"vpdpbusd {codes}, %%zmm{8 + group}, %%zmm{row}")
    if tail:
        for row in range(ROWS):
            lines += [f"vpsubd {256 + 4 * row}(%0)%{{1to16%}}, %%zmm{row}, %%zmm25",
                      "vcvtdq2ps %%zmm25, %%zmm25", "vmulps %%zmm26, %%zmm25, %%zmm25",
                      f"vfmadd231ps {288 + 4 * row}(%0)%{{1to16%}}, %%zmm25, %%zmm{16 + row}"]
    return "\\n".join(lines)  # the C string's line breaks; %{ %} are braces in GCC's asm


def vnni_source() -> tuple[str, str]:
    """The VNNI loop functions and the names `rate` picks them by."""
    clobbers = ", ".join(f'"xmm{i}"' for i in range(27)) + ', "memory"'
    functions, choice = [], []
    for name, broadcast, tail in (("vnni", False, False), ("vnni_broadcast", True, False),
                                  ("vnni_broadcast_tail", True, True)):
        functions.append(f"""
__attribute__((target("avx512f,avx512vnni"))) void {name}(int64_t rounds) {{
  for (int64_t r = 0; r < rounds; ++r)
    asm volatile("{vnni_round(broadcast, tail)}" :: "r"(terms) : {clobbers});
}}""")
        choice.append(f'name == "{name.replace("_", "+")}" ? {name} :')
    header = "alignas(64) int32_t terms[96];\n"
    return header + "\n".join(functions), " ".join(choice)



def one_b_multiply_adds(tokens: int) -> int:
    """The weight multiply-adds of a forward of `tokens` tokens of Llama-3.2-1B's shape (random_gguf.py's)."""
    from random_gguf import SHAPES

    from specserve.bench.offline import multiply_adds_per_token

    shape = SHAPES["llama-3.2-1b"]
    spec = SimpleNamespace(hidden_size=shape.hidden, head_dim=shape.hidden // shape.heads, num_heads=shape.heads,
                           num_kv_heads=shape.kv_heads, num_layers=shape.layers, intermediate_size=shape.ffn,
                           vocab_size=shape.vocab)
    return tokens * multiply_adds_per_token(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per loop and thread count")
    parser.add_argument("--one-token-ms", type=float, default=25.0,
                        help="the 1B shape's one-token step here (docs/benchmarks.md), for the last line")
    parser.add_argument("--avx2-only", action="store_true", help="the AVX2 loops only, on a CPU with VNNI too")
    args = parser.parse_args()
    flags = open("/proc/cpuinfo").read().split()
    if "avx2" not in flags:
        raise SystemExit("this CPU has no AVX2")
    vnni = "avx512_vnni" in flags and not args.avx2_only
    loops, choice = vnni_source() if vnni else ("", "")
    source = SOURCE.replace("VNNI_LOOPS", loops).replace("VNNI_CHOICE", choice)
    module = load_inline("mix_ceiling", cpp_sources=[source], extra_cflags=["-O2", "-mavx2"],
                         build_directory=tempfile.mkdtemp(prefix="mix_ceiling_"))
    threads = torch.get_num_threads()
    print(f"{'loop':<24} {'1 thread':>12} {f'{threads} threads':>12}   (G multiply-adds/s)")
    for loop in LOOPS + (VNNI if vnni else ()):
        one, all_ = (module.rate(loop, n, args.seconds) / 1e9 for n in (1, threads))
        print(f"{loop:<24} {one:>12.1f} {all_:>12.1f}")
    macs = one_b_multiply_adds(8)
    needed = macs / (1.3 * args.one_token_ms / 1e3) / 1e9
    print(f"the 1B shape's 8 tokens ({macs / 1e9:.1f} G multiply-adds) within 1.3x a {args.one_token_ms} ms token: "
          f"{needed:.0f} G/s for the whole forward")


if __name__ == "__main__":
    main()
