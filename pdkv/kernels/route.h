/* MoE routing of float32 router logits (CPU), both schemes models/moe.py's Router implements:
 *   softmax (Qwen3-MoE, Mixtral): p = softmax(logits); the top_k p; optionally renormalised;
 *   sigmoid (DeepSeek-V3): s = sigmoid(logits); selection by s + bias (bias optional) within the
 *   topk_groups groups of the highest top-2 sums (num_groups > 1); weights are s at the chosen
 *   experts, optionally renormalised (+1e-20), times scaling.
 * One call for every token of a step instead of ~15 small tensor ops per layer. Ties in a top-k
 * go to the lower index. */
#ifndef PDKV_ROUTE_H
#define PDKV_ROUTE_H

#include <stdint.h>

#define PDKV_ROUTE_SOFTMAX 0
#define PDKV_ROUTE_SIGMOID 1

/* logits [t, e] contiguous; bias [e] or NULL; ids [t, k], weights [t, k] out (descending by
 * the selection score). Returns 0, or -1 for shapes it does not take (k or e out of 1..1024,
 * groups that do not divide e, topk_groups outside 1..groups, fewer than 2 experts per group,
 * kept groups holding fewer than k experts). */
int pdkv_route(const float *logits, int t, int e, int scheme, const float *bias, int groups, int topk_groups,
               int k, int renormalize, float scaling, int64_t *ids, float *weights);

#endif
