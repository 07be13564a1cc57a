/* epikv's eval callback for llama.cpp: copies the outputs of a few decoder blocks (graph nodes named "l_out-<il>")
 * for every token of a forward, and answers the scheduler's per-node "do you want this node?" question in a few
 * instructions, so a forward pays almost nothing for the ~35 nodes a layer it is asked about.
 * Built by epikv (epikv/llamacpp/capture.py) with the system C compiler; the ggml functions come as pointers from
 * the loaded libggml-base, so nothing links against llama.cpp at build time. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EPIKV_MAX_NODES 64
#define EPIKV_NAME 64

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
} epikv_capture;

static int find(const epikv_capture *c, const char *name) {
    if (name[0] != 'l' || strncmp(name, "l_out-", 6) != 0) return -1;
    for (int i = 0; i < c->n; i++)
        if (strcmp(name, c->names[i]) == 0) return i;
    return -1;
}

bool epikv_eval_cb(void *t, bool ask, void *user_data) {
    epikv_capture *c = (epikv_capture *)user_data;
    int i = find(c, c->get_name(t));
    if (ask) {
        c->asks++;
        return i >= 0;
    }
    if (i < 0) return true;            /* never stop a graph: false would leave it half computed */
    c->type[i] = *(const int32_t *)t;  /* enum ggml_type is the first field of struct ggml_tensor */
    size_t nb = c->nbytes(t);
    if (nb > c->cap[i]) {
        c->got[i] = UINT64_MAX;
        return true;
    }
    c->tensor_get(t, c->dst[i], 0, nb);
    c->got[i] = nb;
    return true;
}
