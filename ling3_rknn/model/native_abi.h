/*
 * The decode kernels' C ABI, declared once. The C sources include this file, so the compiler
 * holds every definition to these prototypes; native_abi.py reads the same text for the
 * Python side (ctypes argument types, the version, the layout constants). Keep it to what
 * native_abi.py reads: `#define NAME <integer>` lines and prototypes whose parameter types
 * are int, int32_t, int64_t, float or pointers.
 */
#ifndef LING3_NATIVE_ABI_H
#define LING3_NATIVE_ABI_H

#include <stdint.h>

/* Bumped with every change to a kernel's signature or meaning: native.py refuses a library
 * whose number differs (one built from older sources), instead of calling it wrongly. */
#define LING3_NATIVE_ABI 8

/* Floats per vector (vf16, native_vec.h): the 16 heads of Ling-3.0-tiny's MLA and the query
 * columns of one prefill tile. */
#define LING3_LANES 16
/* Cache rows mla_attention.c scores before accumulating their context (~147 KB, in L2). */
#define LING3_MLA_GROUP 64
/* Prefill tiles sharing each group of rows: 4 x 32 KB of context plus the rows. */
#define LING3_MLA_TILE_BLOCK 4

/* kda_chunk.c: rows per diagonal block of a chunk whose decay factors are formed pairwise. */
#define LING3_KDA_SUB 16
/* kda_chunk.c: the longest chunk and the head width it takes (16: the same shapes on every
 * vector width). */
#define LING3_KDA_MAX_CHUNK 128
#define LING3_KDA_D_MULTIPLE 16

/* LING3_NATIVE_ABI as compiled into the library. */
int ling3_native_abi(void);

/* The instruction set the compiler targeted, e.g. "x86_64 avx512f avx2 fma f16c" or
 * "aarch64 neon fp16 dotprod" (from its predefined macros: what the code may use). */
const char *ling3_native_isa(void);

/* mla_attention.c: one decode token's heads over the latent cache. scratch:
 * (LING3_MLA_GROUP + 2) * heads floats, plus LING3_MLA_GROUP * stride with `half`. */
int mla_decode_attend(const float *qT, int heads, int d, int r, const void *const *blocks,
                      const int64_t *lengths, int n_blocks, int64_t stride, int half,
                      float *ctxT, float *denom, float *runmax, float *scratch);

/* mla_attention.c: a prefill chunk's causal attention in tiles of LING3_LANES columns.
 * scratch: LING3_MLA_TILE_BLOCK * (LING3_MLA_GROUP + 2) * 16 + 2 * 16 floats, plus
 * LING3_MLA_GROUP * stride with `half`. */
int mla_prefill_attend(const float *qT, const int32_t *lane_pos, int tiles, int d, int r,
                       int score_offset, const void *const *blocks, const int64_t *lengths,
                       int n_blocks, int64_t stride, int half, int64_t mask_from,
                       float *ctxT, float *scratch);

/* kda_decode.c: one decode token of a KDA layer for heads [h0, h1). scratch:
 * 3 * (h1 - h0) * d + 4 * d + 2 * queue floats. Returns 1 if rows were folded. */
int kda_decode_heads(const float *qkv, float *tail, const float *taps, int k, int heads, int d,
                     const float *log_decay, const float *beta, float *body, float *scale,
                     float *keys, float *deltas, int queue, int pending, float fold_below,
                     float fold_rows_below, float *out, int h0, int h1, float *scratch);

/* kda_chunk.c: a prefill piece of a KDA layer (the chunked delta rule) for heads [h0, h1),
 * the state updated in place. scratch: chunk * (5 * d + 2 * chunk + 1) + (LING3_KDA_SUB + 2)
 * * d floats. Returns 0, or -1 for a shape it does not take (nothing touched). */
int kda_chunk_heads(const float *q, const float *k, const float *v, const float *log_decay,
                    const float *beta, int t_len, int heads, int d, int chunk, float *state,
                    float *out, int h0, int h1, float *scratch);

/* attn_softmax.c: one piece of cached rows in the online softmax of a prefill chunk whose
 * Q.K^T and P.V run on the NPU. scores [m, n]; row i sees its first limit[i] columns. The
 * running max, denominator [m] and context acc [m, dv] are carried across pieces (max
 * starts at -FLT_MAX, the others at 0) and rescaled here; p [m, n] gets the float16 bits
 * of exp(score - max) (to 2^-18 relative before the rounding), 0 where unseen. Returns 0, -1
 * for a limit outside [0, n] (nothing touched), -2 where this build has no float16
 * conversion. */
int attn_softmax_piece(const float *scores, int m, int n, const int32_t *limit, float *run_max,
                       float *denom, float *acc, int dv, uint16_t *p);

/* attn_softmax.c: dst[i][0:cols] = float16(src[i][0:cols] * scale) for i < rows (strides in
 * elements; dst's other columns untouched). Returns 0, -2 where this build has no float16
 * conversion. */
int half_rows(const float *src, int rows, int cols, int64_t src_stride, float scale,
              uint16_t *dst, int64_t dst_stride);

/* moe_int8.c: the routed experts' activations around their int8 NPU matmuls. Rows rows[i]
 * of src [*, d] quantised per row into dst [m, d] with scales [m] (max|x| / 127). */
int moe_quantize_rows(const float *src, int d, const int64_t *rows, int m, int8_t *dst,
                      float *scales);

/* moe_int8.c: gate|up products c [m, 2 * inter] (int32) dequantised by row_scale [m] x
 * col_scale [2 * inter], SiLU(gate) * up, quantised per row into dst [m, inter] with
 * dst_scale [m]. scratch: inter floats. */
int moe_swiglu_quantize(const int32_t *c, int m, int inter, const float *row_scale,
                        const float *col_scale, int8_t *dst, float *dst_scale, float *scratch);

/* moe_int8.c: down products c [m, d] (int32) dequantised by row_scale [m] x col_scale [d],
 * times weight [m], added into out[rows[i]] ([*, d] float32). */
int moe_scatter_add(const int32_t *c, int m, int d, const float *row_scale,
                    const float *col_scale, const float *weight, const int64_t *rows,
                    float *out);

#endif
