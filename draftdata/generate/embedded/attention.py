"""Decode attention over the cache's 16-bit keys and values, with float32 scores.

A decode step's queries are one token per request; a capacity class's rows hold its requests' keys, each row padded
to the class's widest (cache.py). torch's SDPA runs that through its flash-attention kernel, made for blocks of
queries: with one query a row it computes in the keys' 16-bit dtype (the query rounded to it, the probabilities too
before they meet the values), slowly on a CPU without 16-bit matmul units (no AVX-512 BF16, no AMX); SDPA in float32
would need the keys and values copied to float32 in every layer of every step. torch's inductor compiles the same
arithmetic (`reference` below) into loops no faster than SDPA here, and adds a hundred-odd microseconds of dispatch
to each of a step's calls.

So one small C++ kernel (`KERNEL`) does a class's rows in one call: each (row, key head) pair, in parallel on
torch's threads, stores the row's new key and value, reads its keys and values once, only as far as its length,
widens them to float32 and computes the scores of the query heads that share the key head, their softmax and the
output, all in float32. It is
built once per machine by torch's extension builder (`torch.utils.cpp_extension.load_inline`, for this CPU's vector
units: `-march=native`; cached under TORCH_EXTENSIONS_DIR/draftdata), at the engine's first start. Where it cannot
be built (no C++ compiler), `reference` runs instead: the same float32 arithmetic through SDPA on float32 copies,
slower.
Figures: docs/benchmarks.md (the embedded engine).
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

KERNEL = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// One (row, key head) pair: the `per` query heads that read that key head (q: [per, dim], float32, scaled) against
// the row's first `len` keys and values (a position's `dim` values contiguous, positions `pos` apart), into out.
template <typename T>
static void attend_one(const float* q, const T* k, const T* v, int64_t pos, int64_t len, int64_t per, int64_t dim,
                       float* out, std::vector<float>& scores, std::vector<float>& wide) {
  scores.resize(per * len);
  for (int64_t w = 0; w < len; ++w) {  // scores: each key widened once, met by every query head
    for (int64_t d = 0; d < dim; ++d) wide[d] = static_cast<float>(k[w * pos + d]);
    for (int64_t g = 0; g < per; ++g) {
      const float* qg = q + g * dim;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < dim; ++d) acc += qg[d] * wide[d];
      scores[g * len + w] = acc;
    }
  }
  for (int64_t g = 0; g < per; ++g) {  // softmax, in place
    float* s = scores.data() + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t w = 0; w < len; ++w) top = std::max(top, s[w]);
    float sum = 0.f;
    for (int64_t w = 0; w < len; ++w) {
      s[w] = std::exp(s[w] - top);
      sum += s[w];
    }
    for (int64_t w = 0; w < len; ++w) s[w] /= sum;
    std::fill(out + g * dim, out + (g + 1) * dim, 0.f);
  }
  for (int64_t w = 0; w < len; ++w) {  // output: each value widened once, added into every query head's
    for (int64_t d = 0; d < dim; ++d) wide[d] = static_cast<float>(v[w * pos + d]);
    for (int64_t g = 0; g < per; ++g) {
      const float p = scores[g * len + w];
      float* o = out + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += p * wide[d];
    }
  }
}

// q [n, heads, per, dim] float32 contiguous; k_new, v_new [n, heads, dim] float32 contiguous, each row's new key
// and value, stored at its position length - 1 in k and v; k, v [n, heads, width, dim] of one dtype, each
// position's dim values contiguous (views of the cache's rows: any row, head and position strides); lengths [n].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32, 4-d");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.scalar_type() == v.scalar_type(), "k, v");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3) && k.stride(3) == 1, "k");
  for (const auto* t : {&k_new, &v_new}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "k_new, v_new: contiguous float32");
    TORCH_CHECK(t->dim() == 3 && t->size(0) == q.size(0) && t->size(1) == q.size(1) && t->size(2) == q.size(3));
  }
  const auto lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == q.size(0), "lengths: one per row");
  const int64_t heads = q.size(1), per = q.size(2), dim = q.size(3), width = k.size(2);
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) TORCH_CHECK(len[r] >= 1 && len[r] <= width, "lengths: 1 to width");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "decode_attention", [&] {
    scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, wide(dim);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t r = job / heads, h = job % heads, pos = k.stride(2);
        const int64_t at_k = r * k.stride(0) + h * k.stride(1), at_new = (len[r] - 1) * pos;
        const float* kn = k_new.data_ptr<float>() + job * dim;
        const float* vn = v_new.data_ptr<float>() + job * dim;
        for (int64_t d = 0; d < dim; ++d) {  // the new key and value into the cache, rounded as .to(dtype) rounds
          kp[at_k + at_new + d] = static_cast<scalar_t>(kn[d]);
          vp[at_k + at_new + d] = static_cast<scalar_t>(vn[d]);
        }
        attend_one(q.data_ptr<float>() + job * per * dim, kp + at_k, vp + at_k, pos, len[r], per, dim,
                   out.data_ptr<float>() + job * per * dim, scores, wide);
      }
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(NAMESPACE, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k, Tensor(b!) v, Tensor lengths)"
      " -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("decode_attention", &decode_attention); }
"""

_built: dict = {}
_lock = threading.Lock()


def reference(q, k_new, v_new, k, v, lengths):
    """The arithmetic: q [n, kv heads, queries per kv head, dim], float32, already scaled (the query heads that read
    one key head: GQA without repeating keys); k_new and v_new [n, kv heads, dim], float32, each row's new key and
    value, stored first at its position length - 1 of k and v: [n, kv heads, width, dim], the rows' keys and values
    in the cache's dtype; lengths [n], each row's keys with the new one (the rest of its width is padding, finite).
    The attention output, shaped as q, in float32: SDPA on float32 copies of the keys and values."""
    import torch
    import torch.nn.functional as F

    rows, at = torch.arange(len(lengths)), lengths - 1
    k[rows, :, at] = k_new.to(k.dtype)
    v[rows, :, at] = v_new.to(v.dtype)
    mask = (torch.arange(k.shape[2], device=k.device)[None, :] < lengths[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, scale=1.0)


def kernel():
    """`KERNEL`'s op, built (or loaded from the build cache) and checked against `reference` on a small case; None
    where it cannot be built here. Once per process."""
    with _lock:
        if "op" not in _built:
            _built["op"] = _build()
    return _built["op"]


def _build():
    import torch

    source = KERNEL.replace("NAMESPACE", "draftdata_attention")
    try:
        library = _library(source)
        if not hasattr(torch.ops.draftdata_attention, "decode_attention"):  # a build just now loaded it already
            torch.ops.load_library(library)
        op = torch.ops.draftdata_attention.decode_attention
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(3, 2, 2, 16, generator=gen)
        new = [torch.randn(3, 2, 16, generator=gen) for _ in range(2)]
        k, v = (torch.randn(4, 2, 64, 16, generator=gen).to(torch.bfloat16)[:3, :, :40] for _ in range(2))
        lengths = torch.tensor([40, 7, 1])
        want = reference(q, *new, k.clone(), v.clone(), lengths)
        ok = torch.allclose(op(q, *new, k, v, lengths), want, atol=1e-5)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a toolchain torch cannot drive: the reference runs
        last = (str(e).strip().splitlines() or [""])[-1]  # a compiler's last line says what stopped it
        _fell_back(f"it could not be built ({type(e).__name__}: {last[:200]})")
        return None
    if not ok:
        _fell_back("it disagreed with the reference on its check")
    return op if ok else None


def _fell_back(why: str) -> None:
    """The one line (once a process: `kernel` builds once) that says the reference runs and what that changes."""
    from draftdata.util.log import log

    log(
        "backend",
        warning=f"the decode-attention kernel is not used: {why}; its float32 SDPA reference runs instead, slower, "
        "and rounding apart from the kernel (rows record it: attention=reference)",
    )


def _library(source: str) -> Path:
    """The kernel's shared library, built where it is not in the cache yet. The cache holds one per source, torch
    version and kind of CPU (the binary is this CPU's: -march=native); a build runs in a directory of its own and
    its library is renamed into place whole, so that a build killed half way leaves nothing another start would
    wait on (torch's own build directories are shared and locked, and a killed build leaves the lock behind)."""
    import os
    import tempfile

    import torch
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-march=native", "-fopenmp"]
    key = hashlib.sha256("\n".join([source, torch.__version__, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / "draftdata"
    library = root / f"attention-{key}.so"
    if library.exists():
        return library
    from draftdata.util.log import log

    # once per machine (and torch version): a first generate stage would otherwise sit silent for 20-70 s on 2 cores
    # (22 s on a quiet machine, python -m bench.demo --fresh-kernel; 70 s on a busy one)
    log("backend", status="building the decode-attention kernel for this CPU: once per machine, 20-70 s on 2 cores")
    t0 = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as build:
        # is_python_module=False: built and loaded as a library of ops (the op is registered from here on)
        load_inline(
            "draftdata_attention",
            cpp_sources=[source],
            extra_cflags=flags,
            build_directory=build,
            is_python_module=False,
        )
        staged = Path(build) / "staged.so"
        staged.write_bytes((Path(build) / "draftdata_attention.so").read_bytes())
        staged.replace(library)
    log("backend", status=f"decode-attention kernel built in {time.monotonic() - t0:.0f} s, kept for the next runs")
    return library


def _cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    return next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
