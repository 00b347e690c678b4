# cython: language_level=3
"""pdkv/kernels/*.c for Python: the CPU kernels of small decode steps, over raw addresses.

Internal: models/cpu_kernels.py and models/attention/cpu_decode.py check every shape, stride,
dtype and device before they pass a tensor's address here; nothing in this module can.
"""
from libc.stdint cimport int64_t, uintptr_t

cdef extern from "kernels/gemm_small.h":
    int pdkv_gemm_small_supported() nogil
    const char *pdkv_gemm_path() nogil
    int pdkv_gemm_set_path(const char *name) nogil
    void pdkv_gemm_small(const float *x, Py_ssize_t ldx, const float *w, Py_ssize_t ldw, const float *bias,
                         float *y, Py_ssize_t ldy, int m, int k, int n) nogil

cdef extern from "kernels/pool.h":
    void pdkv_pool_set_threads(int n) nogil
    int pdkv_pool_threads() nogil
    unsigned long pdkv_pool_split_calls() nogil
    int PDKV_POOL_MAX_THREADS

cdef extern from "kernels/gemm_bf16.h":
    int pdkv_gemm_bf16_supported() nogil
    void pdkv_gemm_bf16(const unsigned short *x, Py_ssize_t ldx, const unsigned short *w, Py_ssize_t ldw,
                        const unsigned short *bias, unsigned short *y, Py_ssize_t ldy, int m, int k, int n) nogil

cdef extern from "kernels/attention_decode.h":
    struct pdkv_paged_kv:
        const float *cache
        Py_ssize_t page_stride, head_stride, slot_stride, v_offset
        int64_t num_pages
        int page_size
    struct pdkv_kv_write:
        const float *k
        const float *v
        Py_ssize_t k_row, k_head, v_row, v_head
        const int64_t *pages
        const int64_t *offsets
    int pdkv_decode_attention(const float *q, Py_ssize_t q_row, const pdkv_paged_kv *kv,
                              const pdkv_kv_write *write, const int64_t *pages, Py_ssize_t pages_row,
                              const int64_t *kv_lens, int window, float *out, Py_ssize_t out_row, int b, int hkv,
                              int g, int d, int dv, float scale) nogil

cdef extern from "kernels/mlp.h":
    int pdkv_gated_mlp(const float *x, Py_ssize_t ldx, const float *gate_up, Py_ssize_t ldgu, const float *down,
                       Py_ssize_t ldd, float *y, Py_ssize_t ldy, int m, int h, int inter) nogil
    int pdkv_moe_one_token(const float *x, const float *gate_up, Py_ssize_t gu_stride, Py_ssize_t ldgu,
                           const float *down, Py_ssize_t down_stride, Py_ssize_t ldd, const int64_t *ids,
                           const float *weights, int k, int64_t num_experts, int64_t first, int64_t local,
                           int h, int inter, float *out) nogil

cdef extern from "kernels/fp8.h":
    void pdkv_fp8_dequant(const unsigned char *w, Py_ssize_t ldw, const float *scale, Py_ssize_t lds,
                          const float *lut, float *out, Py_ssize_t ldo, int n, int k, int bn, int bk) nogil

cdef extern from "kernels/argmax.h":
    int pdkv_argmax_rows(const float *x, Py_ssize_t ld, int rows, int n, int64_t *out) nogil

cdef extern from "kernels/norm.h":
    void pdkv_rms_norm(const float *x, Py_ssize_t outer_stride, Py_ssize_t inner_stride, const float *w, float *y,
                       int outer, int inner, int dim, float eps) nogil

cdef extern from "kernels/route.h":
    int pdkv_route(const float *logits, int t, int e, int scheme, const float *bias, int groups, int topk_groups,
                   int k, int renormalize, float scaling, int64_t *ids, float *weights) nogil

cdef extern from "kernels/rope.h":
    void pdkv_norm_rope(const float *x, Py_ssize_t x_row, int t, int heads, int d, const float *norm_w, float eps,
                        const float *cos, const float *sin, float *out) nogil

cdef extern from "kernels/mla_decode.h":
    struct pdkv_mla_weights:
        const float *kv_norm
        float eps
        const float *w_uk
        Py_ssize_t uk_head, uk_row
        const float *w_uv
        Py_ssize_t uv_head, uv_row
        int heads, nope, rope, lora, value
        float scale
    int pdkv_mla_decode(const float *q, Py_ssize_t q_row, const float *kv, Py_ssize_t kv_row, const float *cos,
                        const float *sin, const pdkv_mla_weights *wt, const pdkv_paged_kv *cache,
                        const int64_t *slot_pages, const int64_t *slot_offsets, const int64_t *pages,
                        Py_ssize_t pages_row, const int64_t *kv_lens, float *out, int t) nogil

# The CPU runs the AVX2+FMA kernels (x86-64 with both): every function below needs it.
SUPPORTED = bool(pdkv_gemm_small_supported())
# The CPU has AVX-512F/BW and AVX512-BF16: ``gemm_bf16`` needs it.
BF16 = bool(pdkv_gemm_bf16_supported())


MAX_THREADS = PDKV_POOL_MAX_THREADS


def set_threads(int n):
    """The threads every kernel call may split across, the caller's included (kernels/pool.h;
    clamped to 1..MAX_THREADS). A call smaller than a worker's wake-up runs on the caller alone."""
    pdkv_pool_set_threads(n)


def threads():
    return pdkv_pool_threads()


def split_calls():
    """Kernel calls so far that ran on more than one thread."""
    return pdkv_pool_split_calls()


def gemm_path():
    """The ISA path of ``gemm`` and the kernels over it: "avx512", "avx2", "pairs" or "none"."""
    return pdkv_gemm_path().decode()


def set_gemm_path(str name):
    """Makes ``gemm`` take path ``name`` (tests and the bench); ValueError when this CPU cannot."""
    if pdkv_gemm_set_path(name.encode()) != 0:
        raise ValueError(f"gemm path {name!r}: unknown, or this CPU cannot run it "
                         f"(paths: avx512, avx2, pairs)")


def gemm(uintptr_t x, Py_ssize_t ldx, uintptr_t w, Py_ssize_t ldw, uintptr_t bias, uintptr_t y, Py_ssize_t ldy,
         int m, int k, int n):
    """y[r, o] = sum_i x[r * ldx + i] * w[o * ldw + i] (+ bias[o]); strides in floats, bias 0: none."""
    with nogil:
        pdkv_gemm_small(<const float *>x, ldx, <const float *>w, ldw, <const float *>bias, <float *>y, ldy, m, k, n)


def gemm_bf16(uintptr_t x, Py_ssize_t ldx, uintptr_t w, Py_ssize_t ldw, uintptr_t bias, uintptr_t y,
              Py_ssize_t ldy, int m, int k, int n):
    """``gemm`` over bfloat16 (float32 sums, y rounded once); strides in elements, bias 0: none."""
    with nogil:
        pdkv_gemm_bf16(<const unsigned short *>x, ldx, <const unsigned short *>w, ldw,
                       <const unsigned short *>bias, <unsigned short *>y, ldy, m, k, n)


def gemm_batched(int batch, uintptr_t x, Py_ssize_t bx, Py_ssize_t ldx, uintptr_t w, Py_ssize_t bw,
                 Py_ssize_t ldw, uintptr_t y, Py_ssize_t by, Py_ssize_t ldy, int m, int k, int n):
    """``gemm`` for b in range(batch) with x, w and y advanced by bx, bw and by floats."""
    cdef int b
    cdef const float *xp = <const float *>x
    cdef const float *wp = <const float *>w
    cdef float *yp = <float *>y
    with nogil:
        for b in range(batch):
            pdkv_gemm_small(xp + b * bx, ldx, wp + b * bw, ldw, NULL, yp + b * by, ldy, m, k, n)


def decode_attention(uintptr_t q, Py_ssize_t q_row, uintptr_t cache, Py_ssize_t page_stride,
                     Py_ssize_t head_stride, Py_ssize_t slot_stride, Py_ssize_t v_offset, int64_t num_pages,
                     int page_size, uintptr_t pages, Py_ssize_t pages_row, uintptr_t kv_lens, int window,
                     uintptr_t out, Py_ssize_t out_row, int b, int hkv, int g, int d, int dv, float scale,
                     uintptr_t k_new=0, Py_ssize_t k_row=0, Py_ssize_t k_head=0, uintptr_t v_new=0,
                     Py_ssize_t v_row=0, Py_ssize_t v_head=0, uintptr_t slot_pages=0, uintptr_t slot_offsets=0):
    """pdkv_decode_attention (kernels/attention_decode.h), storing k_new / v_new first when k_new
    is given; raises ValueError on a page id, a slot or a length out of range."""
    cdef pdkv_paged_kv kv
    cdef pdkv_kv_write wr
    cdef const pdkv_kv_write *wp = NULL
    cdef int rc
    kv.cache = <const float *>cache
    kv.page_stride, kv.head_stride, kv.slot_stride, kv.v_offset = page_stride, head_stride, slot_stride, v_offset
    kv.num_pages, kv.page_size = num_pages, page_size
    if k_new:
        wr.k, wr.v = <const float *>k_new, <const float *>v_new
        wr.k_row, wr.k_head, wr.v_row, wr.v_head = k_row, k_head, v_row, v_head
        wr.pages, wr.offsets = <const int64_t *>slot_pages, <const int64_t *>slot_offsets
        wp = &wr
    with nogil:
        rc = pdkv_decode_attention(<const float *>q, q_row, &kv, wp, <const int64_t *>pages, pages_row,
                                   <const int64_t *>kv_lens, window, <float *>out, out_row, b, hkv, g, d, dv, scale)
    if rc != 0:
        raise ValueError("decode attention: a page id, a slot, a kv length or a head shape is out of range")


def gated_mlp(uintptr_t x, Py_ssize_t ldx, uintptr_t gate_up, Py_ssize_t ldgu, uintptr_t down, Py_ssize_t ldd,
              uintptr_t y, Py_ssize_t ldy, int m, int h, int inter):
    """pdkv_gated_mlp (kernels/mlp.h)."""
    cdef int rc
    with nogil:
        rc = pdkv_gated_mlp(<const float *>x, ldx, <const float *>gate_up, ldgu, <const float *>down, ldd,
                            <float *>y, ldy, m, h, inter)
    if rc != 0:
        raise MemoryError("gated MLP: no memory for its activations")


def moe_one_token(uintptr_t x, uintptr_t gate_up, Py_ssize_t gu_stride, Py_ssize_t ldgu, uintptr_t down,
                  Py_ssize_t down_stride, Py_ssize_t ldd, uintptr_t ids, uintptr_t weights, int k,
                  int64_t num_experts, int64_t first, int64_t local, int h, int inter, uintptr_t out):
    """pdkv_moe_one_token (kernels/mlp.h); raises ValueError for an expert id out of range."""
    cdef int rc
    with nogil:
        rc = pdkv_moe_one_token(<const float *>x, <const float *>gate_up, gu_stride, ldgu, <const float *>down,
                                down_stride, ldd, <const int64_t *>ids, <const float *>weights, k,
                                num_experts, first, local, h, inter, <float *>out)
    if rc != 0:
        raise ValueError(f"one-token MoE: an expert id outside 0..{num_experts - 1} (or no memory)")


def fp8_dequant(uintptr_t w, Py_ssize_t ldw, uintptr_t scale, Py_ssize_t lds, uintptr_t lut, uintptr_t out,
                Py_ssize_t ldo, int n, int k, int bn, int bk):
    """pdkv_fp8_dequant (kernels/fp8.h)."""
    with nogil:
        pdkv_fp8_dequant(<const unsigned char *>w, ldw, <const float *>scale, lds, <const float *>lut,
                         <float *>out, ldo, n, k, bn, bk)


def argmax_rows(uintptr_t x, Py_ssize_t ld, int rows, int n, uintptr_t out):
    """pdkv_argmax_rows (kernels/argmax.h): False when a row holds a NaN (out unspecified)."""
    cdef int rc
    with nogil:
        rc = pdkv_argmax_rows(<const float *>x, ld, rows, n, <int64_t *>out)
    return rc == 0


def rms_norm(uintptr_t x, Py_ssize_t outer_stride, Py_ssize_t inner_stride, uintptr_t w, uintptr_t y, int outer,
             int inner, int dim, float eps):
    """pdkv_rms_norm (kernels/norm.h)."""
    with nogil:
        pdkv_rms_norm(<const float *>x, outer_stride, inner_stride, <const float *>w, <float *>y, outer, inner,
                      dim, eps)


def route(uintptr_t logits, int t, int e, bint sigmoid, uintptr_t bias, int groups, int topk_groups, int k,
          bint renormalize, float scaling, uintptr_t ids, uintptr_t weights):
    """pdkv_route (kernels/route.h); raises ValueError for a routing shape it does not take."""
    cdef int rc
    with nogil:
        rc = pdkv_route(<const float *>logits, t, e, 1 if sigmoid else 0, <const float *>bias, groups, topk_groups,
                        k, renormalize, scaling, <int64_t *>ids, <float *>weights)
    if rc != 0:
        raise ValueError(f"MoE routing: {e} experts in {groups} groups ({topk_groups} kept), top {k}: not a "
                         "shape the kernel takes")


def norm_rope(uintptr_t x, Py_ssize_t x_row, int t, int heads, int d, uintptr_t norm_w, float eps, uintptr_t cos,
              uintptr_t sin, uintptr_t out):
    """pdkv_norm_rope (kernels/rope.h); norm_w 0: no norm."""
    with nogil:
        pdkv_norm_rope(<const float *>x, x_row, t, heads, d, <const float *>norm_w, eps, <const float *>cos,
                       <const float *>sin, <float *>out)


def mla_decode(uintptr_t q, Py_ssize_t q_row, uintptr_t kv, Py_ssize_t kv_row, uintptr_t cos, uintptr_t sin,
               uintptr_t kv_norm, float eps, uintptr_t w_uk, Py_ssize_t uk_head, Py_ssize_t uk_row, uintptr_t w_uv,
               Py_ssize_t uv_head, Py_ssize_t uv_row, int heads, int nope, int rope, int lora, int value,
               float scale, uintptr_t cache, Py_ssize_t page_stride, Py_ssize_t slot_stride, int64_t num_pages,
               int page_size, uintptr_t slot_pages, uintptr_t slot_offsets, uintptr_t pages, Py_ssize_t pages_row,
               uintptr_t kv_lens, uintptr_t out, int t):
    """pdkv_mla_decode (kernels/mla_decode.h); raises ValueError on a page id, a slot or a length
    out of range."""
    cdef pdkv_mla_weights wt
    cdef pdkv_paged_kv kvc
    cdef int rc
    wt.kv_norm, wt.eps = <const float *>kv_norm, eps
    wt.w_uk, wt.uk_head, wt.uk_row = <const float *>w_uk, uk_head, uk_row
    wt.w_uv, wt.uv_head, wt.uv_row = <const float *>w_uv, uv_head, uv_row
    wt.heads, wt.nope, wt.rope, wt.lora, wt.value, wt.scale = heads, nope, rope, lora, value, scale
    kvc.cache = <const float *>cache
    kvc.page_stride, kvc.head_stride, kvc.slot_stride, kvc.v_offset = page_stride, 0, slot_stride, 0
    kvc.num_pages, kvc.page_size = num_pages, page_size
    with nogil:
        rc = pdkv_mla_decode(<const float *>q, q_row, <const float *>kv, kv_row, <const float *>cos,
                             <const float *>sin, &wt, &kvc, <const int64_t *>slot_pages,
                             <const int64_t *>slot_offsets, <const int64_t *>pages, pages_row,
                             <const int64_t *>kv_lens, <float *>out, t)
    if rc != 0:
        raise ValueError("MLA decode: a page id, a slot or a kv length is out of range (or no memory)")
