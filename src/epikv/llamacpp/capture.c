/* epikv's eval callback for llama.cpp: copies a few named graph nodes for every token of a forward (the outputs of
 * decoder blocks, "l_out-<il>", and, for the policies that read them, the rotated queries and keys "Qcur-<il>" /
 * "Kcur-<il>" whose op is ROPE and the values "Vcur-<il>"), and answers the scheduler's per-node "do you want this
 * node?" question in a few instructions, so a forward pays almost nothing for the ~35 nodes a layer it is asked
 * about. Built by epikv (epikv/llamacpp/capture.py) with the system C compiler; the ggml functions come as pointers
 * from the loaded libggml-base, so nothing links against llama.cpp at build time. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EPIKV_MAX_NODES 256
#define EPIKV_NAME 64

/* the leading fields of struct ggml_tensor (ggml.h), in its order */
typedef struct {
    int32_t type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int32_t op;
} epikv_tensor_head;

typedef struct {
    const char *(*get_name)(const void *);
    size_t (*nbytes)(const void *);
    void (*tensor_get)(const void *, void *, size_t, size_t);
    int32_t n;                              /* nodes wanted */
    int32_t pad;
    char names[EPIKV_MAX_NODES][EPIKV_NAME];
    void *dst[EPIKV_MAX_NODES];             /* destination buffers (owned by Python) */
    uint64_t cap[EPIKV_MAX_NODES];          /* their size in bytes */
    uint64_t got[EPIKV_MAX_NODES];          /* bytes copied in the last forward; UINT64_MAX: did not fit */
    int32_t type[EPIKV_MAX_NODES];          /* ggml type of the node seen */
    uint64_t asks;                          /* ask-phase calls (counted for the cost report) */
    int32_t want_op[EPIKV_MAX_NODES];       /* the node's ggml op must be this one; -1: any op */
    int64_t ne[EPIKV_MAX_NODES][4];         /* shape of the node seen */
    uint64_t nb[EPIKV_MAX_NODES][4];        /* its strides in bytes */
} epikv_capture;

static int find(const epikv_capture *c, const char *name, const epikv_tensor_head *t) {
    for (int i = 0; i < c->n; i++)
        if (name[0] == c->names[i][0] && strcmp(name, c->names[i]) == 0 && (c->want_op[i] < 0 || c->want_op[i] == t->op))
            return i;
    return -1;
}

bool epikv_eval_cb(void *t, bool ask, void *user_data) {
    epikv_capture *c = (epikv_capture *)user_data;
    const epikv_tensor_head *h = (const epikv_tensor_head *)t;
    int i = find(c, c->get_name(t), h);
    if (ask) {
        c->asks++;
        return i >= 0;
    }
    if (i < 0) return true;            /* never stop a graph: false would leave it half computed */
    c->type[i] = h->type;
    for (int d = 0; d < 4; d++) {
        c->ne[i][d] = h->ne[d];
        c->nb[i][d] = (uint64_t)h->nb[d];
    }
    size_t nb = c->nbytes(t);
    if (nb > c->cap[i]) {
        c->got[i] = UINT64_MAX;
        return true;
    }
    c->tensor_get(t, c->dst[i], 0, nb);
    c->got[i] = nb;
    return true;
}
