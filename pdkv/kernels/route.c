/* See route.h. Plain C: a step routes a few tokens over tens to hundreds of experts. */
#include "route.h"

#include <math.h>
#include <string.h>

#define MAX_EXPERTS 1024

/* the indices of the k largest of v[0..n) (skipping those with allowed[i] == 0 when allowed is
 * given), largest first, ties to the lower index */
static void top_k(const float *v, int n, const unsigned char *allowed, int k, int *out)
{
    int got = 0;
    for (int i = 0; i < n; i++) {
        if (allowed && !allowed[i])
            continue;
        int j;
        if (got < k)
            j = got++;
        else if (v[i] > v[out[k - 1]])
            j = k - 1;
        else
            continue;
        while (j > 0 && v[i] > v[out[j - 1]]) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = i;
    }
}

/* ids and weights of the k picks (weight = score at the pick); returns the weights' sum, in order */
static float take(const float *score, const int *pick, int k, int64_t *id, float *w)
{
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        id[j] = pick[j];
        w[j] = score[pick[j]];
        total += w[j];
    }
    return total;
}

int pdkv_route(const float *logits, int t, int e, int scheme, const float *bias, int groups, int topk_groups,
               int k, int renormalize, float scaling, int64_t *ids, float *weights)
{
    if (e < 1 || e > MAX_EXPERTS || k < 1 || k > e || t < 0)
        return -1;
    if (scheme == PDKV_ROUTE_SIGMOID && groups > 1
        && (e % groups || topk_groups < 1 || topk_groups > groups || e / groups < 2
            || topk_groups * (e / groups) < k))
        return -1;
    float score[MAX_EXPERTS], choice[MAX_EXPERTS];
    unsigned char allowed[MAX_EXPERTS];
    int pick[MAX_EXPERTS];
    for (int r = 0; r < t; r++) {
        const float *l = logits + (int64_t)r * e;
        int64_t *id = ids + (int64_t)r * k;
        float *w = weights + (int64_t)r * k;
        if (scheme == PDKV_ROUTE_SOFTMAX) {
            float mx = l[0];
            for (int i = 1; i < e; i++)
                if (l[i] > mx)
                    mx = l[i];
            float sum = 0.0f;
            for (int i = 0; i < e; i++) {
                score[i] = expf(l[i] - mx);
                sum += score[i];
            }
            for (int i = 0; i < e; i++)
                score[i] = score[i] / sum;
            top_k(score, e, NULL, k, pick);
            float total = take(score, pick, k, id, w);
            if (renormalize)
                for (int j = 0; j < k; j++)
                    w[j] = w[j] / total;
            continue;
        }
        for (int i = 0; i < e; i++) {
            score[i] = 1.0f / (1.0f + expf(-l[i]));
            choice[i] = bias ? score[i] + bias[i] : score[i];
        }
        const unsigned char *mask = NULL;
        if (groups > 1 && topk_groups < groups) {
            int per = e / groups, two[2], keep[MAX_EXPERTS];
            float gscore[MAX_EXPERTS];
            for (int g = 0; g < groups; g++) {
                top_k(choice + g * per, per, NULL, 2, two);
                gscore[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
            }
            top_k(gscore, groups, NULL, topk_groups, keep);
            memset(allowed, 0, (size_t)e);
            for (int j = 0; j < topk_groups; j++)
                memset(allowed + keep[j] * per, 1, (size_t)per);
            mask = allowed;
        }
        top_k(choice, e, mask, k, pick);
        float total = take(score, pick, k, id, w);
        for (int j = 0; j < k; j++)
            w[j] = (renormalize ? w[j] / (total + 1e-20f) : w[j]) * scaling;
    }
    return 0;
}
