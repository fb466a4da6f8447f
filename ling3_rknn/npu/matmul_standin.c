/* A host stand-in for librknnrt's matmul API (docs/npu-matmul.md, "The stand-in").
 *
 * It exports the rknn_matmul_* / rknn_create_mem / rknn_destroy_mem symbols with the SDK
 * 2.3.2 struct ABI (rknn_matmul_abi.h) and the semantics ling3-rknn relies on, so the
 * ctypes binding (matmul.py) runs the same code against it as against the board's
 * library: B in the RK3588 native layout (a wrongly packed B gives wrong products),
 * fp16 x fp16 -> float32 with float32 accumulation, int8 x int8 -> int32, and the same
 * refusals at create (types, alignment, K, the 4 GB domain; the fp16 shapes that abort
 * librknnrt abort here too). Dynamic shapes (rknn_matmul_create_dynamic_shape /
 * _set_dynamic_shape) as the SDK's demo uses them: only M varies, a run computes exactly the
 * M of the shape in effect (ling3_standin_rows_run counts them, for tests), A and C must be
 * set again after every shape change, B stays. It does not model timing, IOMMU exhaustion
 * across contexts, native A/C layouts or quantised types.
 *
 * Contexts are handles into a table (a bad or destroyed handle is RKNN_ERR_CTX_INVALID,
 * never a crash); one context is run by one thread at a time (the binding locks it);
 * different contexts run concurrently. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rknn_matmul_abi.h"

#define EXPORT __attribute__((visibility("default")))

#define MAX_K 10240
#define SEGMENT_K 8192          /* RK3588 splits B into native segments of 8192 rows */
#define ABORT_LO 16384          /* fp16 K or N in [ABORT_LO, ABORT_HI] aborts librknnrt */
#define ABORT_HI 18432
#define DOMAIN_BYTES (4ULL << 30)
#define MAX_DOMAINS 16
#define MAX_CONTEXTS 256
/* per context: the prefill attention keeps 2 B per head and 2048-row piece on each core's
 * context (6 heads x 16 pieces x 6 layers at 32K), the experts' store ~330 B per context at
 * full size; librknnrt documents no such limit */
#define MAX_MEMS 8192
#define TILE_N 16               /* output columns one inner loop computes */
#define MAX_SHAPES 64           /* per dynamic context */

typedef struct {
    rknn_matmul_ctx handle;     /* 0: free slot */
    rknn_matmul_info info;
    rknn_matmul_io_attr attr;
    int core_mask;
    rknn_tensor_mem *mems[MAX_MEMS];
    rknn_tensor_mem *io[3];     /* A, B, C as set by set_io_mem */
    int n_shapes;               /* 0: a static context; else its declared shapes */
    int current;                /* the shape in effect (-1: none set yet) */
    rknn_matmul_shape shapes[MAX_SHAPES];
    rknn_matmul_io_attr *attrs; /* one per declared shape (malloc'd) */
    int64_t rows_run;           /* sum of M over every run: what the NPU computed */
} context;

static context contexts[MAX_CONTEXTS];
static uint64_t next_serial = 1;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

static float half_table[65536];
static pthread_once_t half_once = PTHREAD_ONCE_INIT;

static float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);                 /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);         /* normal */
    } else if (mant == 0) {
        bits = sign;                                               /* zero */
    } else {                                                       /* subnormal */
        int e = -1;
        do { mant <<= 1; e++; } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void fill_half_table(void) {
    for (uint32_t h = 0; h < 65536; h++) half_table[h] = half_bits_to_float((uint16_t)h);
}

static int slot_of(rknn_matmul_ctx handle) {
    if (handle == 0) return -1;
    int slot = (int)((handle - 1) % MAX_CONTEXTS);
    return contexts[slot].handle == handle ? slot : -1;
}

static context *lookup(rknn_matmul_ctx handle) {
    pthread_mutex_lock(&table_lock);
    int slot = slot_of(handle);
    pthread_mutex_unlock(&table_lock);
    return slot < 0 ? NULL : &contexts[slot];
}

static void set_attr(rknn_matmul_tensor_attr *attr, const char *name, uint32_t n_dims,
                     const uint32_t *dims, uint64_t size, rknn_tensor_type type) {
    memset(attr, 0, sizeof *attr);
    snprintf(attr->name, sizeof attr->name, "%s", name);
    attr->n_dims = n_dims;
    for (uint32_t i = 0; i < n_dims; i++) attr->dims[i] = dims[i];
    attr->size = (uint32_t)size;
    attr->type = type;
}

/* (sub_n, sub_k) of B's native tiles on RK3588 */
static void native_tile(rknn_matmul_type type, int *sub_n, int *sub_k) {
    *sub_n = type == RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 ? 16 : 32;
    *sub_k = 32;
}

/* The element offset of B[k][n] in B's memory. */
static inline size_t b_offset(const rknn_matmul_info *info, int sub_n, int sub_k, int k, int n) {
    if (info->B_layout == RKNN_MM_LAYOUT_NORM) return (size_t)k * info->N + n;
    int seg = k / SEGMENT_K, kk = k % SEGMENT_K;
    int seg_k = info->K - seg * SEGMENT_K;
    if (seg_k > SEGMENT_K) seg_k = SEGMENT_K;
    size_t base = (size_t)seg * SEGMENT_K * info->N;
    return base + (((size_t)(n / sub_n) * (seg_k / sub_k) + kk / sub_k) * sub_n + n % sub_n)
                      * sub_k + kk % sub_k;
}

/* The refusals at create for one (M, K, N) of ``info``'s type and layouts. */
static int check_create(const rknn_matmul_info *info, int M, int K, int N) {
    rknn_matmul_type type = info->type;
    if (type != RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 && type != RKNN_INT8_MM_INT8_TO_INT32) {
        fprintf(stderr, "rknn matmul stand-in: matmul type %d is not modelled (fp16->fp32 "
                "and int8->int32 only; RK3588 refuses the mixed types)\n", type);
        return RKNN_ERR_PARAM_INVALID;
    }
    int sub_n, sub_k;
    native_tile(type, &sub_n, &sub_k);
    if (M < 1 || K < 1 || N < 1 || K > MAX_K || K % sub_k || N % sub_n) {
        fprintf(stderr, "rknn matmul stand-in: M=%d K=%d N=%d refused (K <= %d, K %% %d, "
                "N %% %d)\n", M, K, N, MAX_K, sub_k, sub_n);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (type == RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 &&
        ((K >= ABORT_LO && K <= ABORT_HI) || (N >= ABORT_LO && N <= ABORT_HI))) {
        fprintf(stderr, "rknn matmul stand-in: fp16 M=%d K=%d N=%d aborts librknnrt\n", M, K, N);
        abort();
    }
    if (info->B_layout != RKNN_MM_LAYOUT_NORM && info->B_layout != RKNN_MM_LAYOUT_NATIVE) {
        return RKNN_ERR_PARAM_INVALID;
    }
    if (info->AC_layout != RKNN_MM_LAYOUT_NORM || info->B_quant_type || info->AC_quant_type) {
        fprintf(stderr, "rknn matmul stand-in: native A/C layouts and quantisation are not "
                "modelled\n");
        return RKNN_ERR_PARAM_INVALID;
    }
    if (info->iommu_domain_id < 0 || info->iommu_domain_id >= MAX_DOMAINS) {
        return RKNN_ERR_PARAM_INVALID;
    }
    uint64_t ab = type == RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 ? 2 : 1;
    uint64_t a_size = (uint64_t)M * K * ab, b_size = (uint64_t)K * N * ab;
    uint64_t c_size = (uint64_t)M * N * 4;
    if (a_size + b_size + c_size > DOMAIN_BYTES) return RKNN_ERR_MALLOC_FAIL;
    return RKNN_SUCC;
}

/* What the runtime reports for A, B and C of one (M, K, N). */
static void fill_attrs(const rknn_matmul_info *info, int M, int K, int N,
                       rknn_matmul_io_attr *attr) {
    int sub_n, sub_k;
    native_tile(info->type, &sub_n, &sub_k);
    uint64_t ab = info->type == RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 ? 2 : 1;
    uint64_t a_size = (uint64_t)M * K * ab, b_size = (uint64_t)K * N * ab;
    uint64_t c_size = (uint64_t)M * N * 4;
    rknn_tensor_type a_type = ab == 2 ? RKNN_TENSOR_FLOAT16 : RKNN_TENSOR_INT8;
    uint32_t a_dims[2] = {(uint32_t)M, (uint32_t)K}, c_dims[2] = {(uint32_t)M, (uint32_t)N};
    set_attr(&attr->A, "A", 2, a_dims, a_size, a_type);
    if (info->B_layout == RKNN_MM_LAYOUT_NATIVE) {
        uint32_t seg_k = K < SEGMENT_K ? (uint32_t)K : SEGMENT_K;
        uint32_t b_dims[4] = {(uint32_t)(N / sub_n), seg_k / sub_k, (uint32_t)sub_n,
                              (uint32_t)sub_k};
        set_attr(&attr->B, "B", 4, b_dims, b_size, a_type);
    } else {
        uint32_t b_dims[2] = {(uint32_t)K, (uint32_t)N};
        set_attr(&attr->B, "B", 2, b_dims, b_size, a_type);
    }
    set_attr(&attr->C, "C", 2, c_dims, c_size,
             ab == 2 ? RKNN_TENSOR_FLOAT32 : RKNN_TENSOR_INT32);
}

/* A free slot of the table, cleared and given a fresh handle (under table_lock). */
static context *take_slot(void) {
    int slot = -1;
    for (int tries = 0; tries < MAX_CONTEXTS; tries++) {
        int s = (int)((next_serial - 1) % MAX_CONTEXTS);
        if (contexts[s].handle == 0) { slot = s; break; }
        next_serial++;
    }
    if (slot < 0) return NULL;
    context *c = &contexts[slot];
    memset(c, 0, sizeof *c);
    c->handle = (rknn_matmul_ctx)next_serial;
    next_serial++;
    return c;
}

EXPORT int rknn_matmul_create(rknn_matmul_ctx *ctx, rknn_matmul_info *info,
                              rknn_matmul_io_attr *io_attr) {
    if (ctx == NULL || info == NULL || io_attr == NULL) return RKNN_ERR_PARAM_INVALID;
    *ctx = 0;
    int ret = check_create(info, info->M, info->K, info->N);
    if (ret != RKNN_SUCC) return ret;
    pthread_mutex_lock(&table_lock);
    context *c = take_slot();
    if (c == NULL) {
        pthread_mutex_unlock(&table_lock);
        return RKNN_ERR_MALLOC_FAIL;
    }
    c->info = *info;
    fill_attrs(info, info->M, info->K, info->N, &c->attr);
    *io_attr = c->attr;
    *ctx = c->handle;
    pthread_mutex_unlock(&table_lock);
    return RKNN_SUCC;
}

/* One context for several (M, K, N): info's M, K and N are ignored (the header: "the
 * original info.M, K, N are invalid"); io_attrs[i] describes dynamic_shapes[i]. As the
 * SDK's dynamic-shape demo requires for B in the normal or native layout, every shape has
 * the same K and N, so one B serves them all; the M are distinct. No shape is in effect
 * (no memory can be set, nothing run) until rknn_matmul_set_dynamic_shape. */
EXPORT int rknn_matmul_create_dynamic_shape(rknn_matmul_ctx *ctx, rknn_matmul_info *info,
                                            int shape_num, rknn_matmul_shape dynamic_shapes[],
                                            rknn_matmul_io_attr io_attrs[]) {
    if (ctx == NULL || info == NULL || dynamic_shapes == NULL || io_attrs == NULL) {
        return RKNN_ERR_PARAM_INVALID;
    }
    *ctx = 0;
    if (shape_num < 1 || shape_num > MAX_SHAPES) return RKNN_ERR_PARAM_INVALID;
    for (int i = 0; i < shape_num; i++) {
        const rknn_matmul_shape *sh = &dynamic_shapes[i];
        if (sh->K != dynamic_shapes[0].K || sh->N != dynamic_shapes[0].N) {
            fprintf(stderr, "rknn matmul stand-in: dynamic shapes must share K and N (B in "
                    "the normal or native layout)\n");
            return RKNN_ERR_PARAM_INVALID;
        }
        for (int j = 0; j < i; j++) {
            if (dynamic_shapes[j].M == sh->M) return RKNN_ERR_PARAM_INVALID;
        }
        int ret = check_create(info, sh->M, sh->K, sh->N);
        if (ret != RKNN_SUCC) return ret;
    }
    rknn_matmul_io_attr *attrs = calloc((size_t)shape_num, sizeof *attrs);
    if (attrs == NULL) return RKNN_ERR_MALLOC_FAIL;
    for (int i = 0; i < shape_num; i++) {
        const rknn_matmul_shape *sh = &dynamic_shapes[i];
        fill_attrs(info, sh->M, sh->K, sh->N, &attrs[i]);
    }
    pthread_mutex_lock(&table_lock);
    context *c = take_slot();
    if (c == NULL) {
        pthread_mutex_unlock(&table_lock);
        free(attrs);
        return RKNN_ERR_MALLOC_FAIL;
    }
    c->info = *info;
    c->info.M = c->info.K = c->info.N = 0;
    c->n_shapes = shape_num;
    c->current = -1;
    memcpy(c->shapes, dynamic_shapes, sizeof *dynamic_shapes * (size_t)shape_num);
    c->attrs = attrs;
    memcpy(io_attrs, attrs, sizeof *attrs * (size_t)shape_num);
    *ctx = c->handle;
    pthread_mutex_unlock(&table_lock);
    return RKNN_SUCC;
}

/* The shape the next runs compute: one of those declared at create, else refused. A and C
 * must then be set again with this shape's attributes (the demo: set_io_mem "must call
 * after" set_dynamic_shape); B stays set ("B can not be dynamic"). */
EXPORT int rknn_matmul_set_dynamic_shape(rknn_matmul_ctx ctx, rknn_matmul_shape *shape) {
    context *c = lookup(ctx);
    if (c == NULL) return RKNN_ERR_CTX_INVALID;
    if (shape == NULL || c->n_shapes == 0) return RKNN_ERR_PARAM_INVALID;
    for (int i = 0; i < c->n_shapes; i++) {
        const rknn_matmul_shape *sh = &c->shapes[i];
        if (sh->M == shape->M && sh->K == shape->K && sh->N == shape->N) {
            c->current = i;
            c->info.M = sh->M;
            c->info.K = sh->K;
            c->info.N = sh->N;
            c->attr = c->attrs[i];
            c->io[0] = c->io[2] = NULL;
            return RKNN_SUCC;
        }
    }
    fprintf(stderr, "rknn matmul stand-in: M=%d K=%d N=%d was not declared at create\n",
            shape->M, shape->K, shape->N);
    return RKNN_ERR_PARAM_INVALID;
}

/* Test-only: the rows this context's runs computed (the sum of M), -1 for a bad handle. */
EXPORT int64_t ling3_standin_rows_run(rknn_matmul_ctx ctx) {
    context *c = lookup(ctx);
    return c == NULL ? -1 : c->rows_run;
}

EXPORT int rknn_matmul_set_core_mask(rknn_matmul_ctx ctx, rknn_core_mask mask) {
    context *c = lookup(ctx);
    if (c == NULL) return RKNN_ERR_CTX_INVALID;
    /* a matmul context runs on one core: masks spanning cores are refused */
    if (mask != RKNN_NPU_CORE_AUTO && mask != RKNN_NPU_CORE_0 && mask != RKNN_NPU_CORE_1 &&
        mask != RKNN_NPU_CORE_2) {
        return RKNN_ERR_PARAM_INVALID;
    }
    c->core_mask = mask;
    return RKNN_SUCC;
}

EXPORT rknn_tensor_mem *rknn_create_mem(rknn_context ctx, uint32_t size) {
    context *c = lookup(ctx);
    if (c == NULL || size == 0) return NULL;
    int slot = -1;
    for (int i = 0; i < MAX_MEMS; i++) {
        if (c->mems[i] == NULL) { slot = i; break; }
    }
    if (slot < 0) return NULL;
    rknn_tensor_mem *mem = calloc(1, sizeof *mem);
    void *data = NULL;
    /* fresh memory is zero, as the kernel's DMA buffers are */
    if (mem == NULL || posix_memalign(&data, 64, size) != 0) {
        free(mem);
        return NULL;
    }
    memset(data, 0, size);
    mem->virt_addr = data;
    mem->fd = -1;
    mem->size = size;
    mem->flags = RKNN_TENSOR_MEMORY_FLAGS_ALLOC_INSIDE;
    mem->priv_data = c;
    c->mems[slot] = mem;
    return mem;
}

static void release(context *c, int slot) {
    rknn_tensor_mem *mem = c->mems[slot];
    for (int i = 0; i < 3; i++) {
        if (c->io[i] == mem) c->io[i] = NULL;
    }
    free(mem->virt_addr);
    free(mem);
    c->mems[slot] = NULL;
}

EXPORT int rknn_destroy_mem(rknn_context ctx, rknn_tensor_mem *mem) {
    context *c = lookup(ctx);
    if (c == NULL) return RKNN_ERR_CTX_INVALID;
    for (int i = 0; i < MAX_MEMS; i++) {
        if (mem != NULL && c->mems[i] == mem) {
            release(c, i);
            return RKNN_SUCC;
        }
    }
    return RKNN_ERR_PARAM_INVALID;
}

EXPORT int rknn_matmul_set_io_mem(rknn_matmul_ctx ctx, rknn_tensor_mem *mem,
                                  rknn_matmul_tensor_attr *attr) {
    context *c = lookup(ctx);
    if (c == NULL) return RKNN_ERR_CTX_INVALID;
    if (mem == NULL || attr == NULL) return RKNN_ERR_PARAM_INVALID;
    if (c->n_shapes && c->current < 0) return RKNN_ERR_PARAM_INVALID;  /* no shape yet */
    int owned = 0;
    for (int i = 0; i < MAX_MEMS; i++) owned |= c->mems[i] == mem;
    if (!owned) return RKNN_ERR_PARAM_INVALID;
    const rknn_matmul_tensor_attr *mine[3] = {&c->attr.A, &c->attr.B, &c->attr.C};
    for (int i = 0; i < 3; i++) {
        if (strncmp(attr->name, mine[i]->name, RKNN_MAX_NAME_LEN) == 0) {
            if (mem->size < mine[i]->size) return RKNN_ERR_PARAM_INVALID;
            c->io[i] = mem;
            return RKNN_SUCC;
        }
    }
    return RKNN_ERR_PARAM_INVALID;
}

/* C = A x B for fp16: B is widened into a float scratch laid out [N / 16][K][16], so the
 * inner loop runs over 16 output columns at once (what the compiler vectorises) and the
 * float32 sums of exact fp16 products are independent of the native layout's order. */
static int run_fp16(const context *c) {
    const rknn_matmul_info *info = &c->info;
    int M = info->M, K = info->K, N = info->N, sub_n, sub_k;
    native_tile(info->type, &sub_n, &sub_k);
    const uint16_t *a = c->io[0]->virt_addr, *b = c->io[1]->virt_addr;
    float *out = c->io[2]->virt_addr;
    float *bf = malloc(sizeof(float) * (size_t)K * N);
    float *af = malloc(sizeof(float) * (size_t)K * 4);
    if (bf == NULL || af == NULL) {
        free(bf);
        free(af);
        return RKNN_ERR_MALLOC_FAIL;
    }
    pthread_once(&half_once, fill_half_table);
    for (int nb = 0; nb < N / TILE_N; nb++) {
        for (int k = 0; k < K; k++) {
            float *dst = bf + ((size_t)nb * K + k) * TILE_N;
            for (int j = 0; j < TILE_N; j++) {
                dst[j] = half_table[b[b_offset(info, sub_n, sub_k, k, nb * TILE_N + j)]];
            }
        }
    }
    for (int m0 = 0; m0 < M; m0 += 4) {
        int rows = M - m0 < 4 ? M - m0 : 4;
        for (int r = 0; r < 4; r++) {
            for (int k = 0; k < K; k++) {
                af[r * K + k] = r < rows ? half_table[a[(size_t)(m0 + r) * K + k]] : 0.0f;
            }
        }
        for (int nb = 0; nb < N / TILE_N; nb++) {
            const float *col = bf + (size_t)nb * K * TILE_N;
            float acc[4][TILE_N] = {{0}};
            for (int k = 0; k < K; k++) {
                const float *bk = col + (size_t)k * TILE_N;
                for (int r = 0; r < 4; r++) {
                    float av = af[r * K + k];
                    for (int j = 0; j < TILE_N; j++) acc[r][j] += av * bk[j];
                }
            }
            for (int r = 0; r < rows; r++) {
                memcpy(out + (size_t)(m0 + r) * N + nb * TILE_N, acc[r], sizeof acc[r]);
            }
        }
    }
    free(bf);
    free(af);
    return RKNN_SUCC;
}

/* C = A x B for int8 with int32 sums: |sum| <= K * 128 * 128 <= 10240 * 2^14 < 2^31, so
 * no int8 x int8 product over an allowed K can overflow (nothing to saturate). */
static int run_int8(const context *c) {
    const rknn_matmul_info *info = &c->info;
    int M = info->M, K = info->K, N = info->N, sub_n, sub_k;
    native_tile(info->type, &sub_n, &sub_k);
    const int8_t *a = c->io[0]->virt_addr, *b = c->io[1]->virt_addr;
    int32_t *out = c->io[2]->virt_addr;
    int16_t *bw = malloc(sizeof(int16_t) * (size_t)K * N);
    if (bw == NULL) return RKNN_ERR_MALLOC_FAIL;
    for (int nb = 0; nb < N / TILE_N; nb++) {
        for (int k = 0; k < K; k++) {
            int16_t *dst = bw + ((size_t)nb * K + k) * TILE_N;
            for (int j = 0; j < TILE_N; j++) {
                dst[j] = b[b_offset(info, sub_n, sub_k, k, nb * TILE_N + j)];
            }
        }
    }
    for (int m0 = 0; m0 < M; m0 += 4) {
        int rows = M - m0 < 4 ? M - m0 : 4;
        for (int nb = 0; nb < N / TILE_N; nb++) {
            const int16_t *col = bw + (size_t)nb * K * TILE_N;
            int32_t acc[4][TILE_N] = {{0}};
            for (int k = 0; k < K; k++) {
                const int16_t *bk = col + (size_t)k * TILE_N;
                for (int r = 0; r < 4; r++) {
                    int32_t av = r < rows ? a[(size_t)(m0 + r) * K + k] : 0;
                    for (int j = 0; j < TILE_N; j++) acc[r][j] += av * (int32_t)bk[j];
                }
            }
            for (int r = 0; r < rows; r++) {
                memcpy(out + (size_t)(m0 + r) * N + nb * TILE_N, acc[r], sizeof acc[r]);
            }
        }
    }
    free(bw);
    return RKNN_SUCC;
}

EXPORT int rknn_matmul_run(rknn_matmul_ctx ctx) {
    context *c = lookup(ctx);
    if (c == NULL) return RKNN_ERR_CTX_INVALID;
    if (c->io[0] == NULL || c->io[1] == NULL) return RKNN_ERR_INPUT_INVALID;
    if (c->io[2] == NULL) return RKNN_ERR_OUTPUT_INVALID;
    c->rows_run += c->info.M;
    return c->info.type == RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 ? run_fp16(c) : run_int8(c);
}

EXPORT int rknn_matmul_destroy(rknn_matmul_ctx ctx) {
    pthread_mutex_lock(&table_lock);
    int slot = slot_of(ctx);
    if (slot < 0) {
        pthread_mutex_unlock(&table_lock);
        return RKNN_ERR_CTX_INVALID;
    }
    context *c = &contexts[slot];
    for (int i = 0; i < MAX_MEMS; i++) {
        if (c->mems[i] != NULL) release(c, i);
    }
    free(c->attrs);
    c->attrs = NULL;
    c->handle = 0;
    pthread_mutex_unlock(&table_lock);
    return RKNN_SUCC;
}

/* The whole of B from the normal layout into the native one (the SDK's helper of the same
 * name): a second, independent packer the binding's tests compare theirs with. */
EXPORT int rknn_B_normal_layout_to_native_layout(void *B_input, void *B_output, int K, int N,
                                                 rknn_matmul_info *info) {
    if (B_input == NULL || B_output == NULL || info == NULL) return RKNN_ERR_PARAM_INVALID;
    if (info->type != RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 &&
        info->type != RKNN_INT8_MM_INT8_TO_INT32) {
        return RKNN_ERR_PARAM_INVALID;
    }
    int sub_n, sub_k;
    native_tile(info->type, &sub_n, &sub_k);
    if (K < 1 || N < 1 || K > MAX_K || K % sub_k || N % sub_n) return RKNN_ERR_PARAM_INVALID;
    rknn_matmul_info native = *info;
    native.K = K;
    native.N = N;
    native.B_layout = RKNN_MM_LAYOUT_NATIVE;
    size_t item = info->type == RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 ? 2 : 1;
    const char *src = B_input;
    char *dst = B_output;
    for (int k = 0; k < K; k++) {
        for (int n = 0; n < N; n++) {
            memcpy(dst + item * b_offset(&native, sub_n, sub_k, k, n),
                   src + item * ((size_t)k * N + n), item);
        }
    }
    return RKNN_SUCC;
}
