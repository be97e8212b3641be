/*
 * classes.c - how an output row reads as classes (predictor.h, "how an
 * output row reads as classes"): one rule for online labels, scores and
 * top_k and for a job's predictions, accuracy and confusion matrix.
 *
 * A one-column output is a binary classifier, not a one-class argmax (which
 * is class 0 for every row: a job over a balanced dataset then "scores" the
 * share of label 0). Whether that column is a probability or a logit is
 * the config's to say; with neither declared there is no rule, and the
 * callers say so instead of answering a number.
 */
#include <math.h>
#include <string.h>

#include "predictor.h"

md_classes md_classes_from_config(json_t *config, int64_t width)
{
    md_classes c = {.kind = MD_CLASSES_ARGMAX, .width = width, .classes = width};
    const char *output = json_string_value(json_object_get(config, "output"));
    int probs = output && strcmp(output, "probabilities") == 0;
    c.logits = output && strcmp(output, "logits") == 0;
    json_t *t = json_object_get(config, "threshold");
    c.threshold = json_is_number(t) ? json_number_value(t) : 0.5;
    /* the test on the values themselves: sigmoid(y) > t is y > logit(t),
     * exactly 0 for the default 0.5, so no rounding of a sigmoid decides */
    c.cut = c.logits ? log(c.threshold / (1.0 - c.threshold)) : c.threshold;
    if (json_is_true(json_object_get(config, "multi_label"))) {
        c.kind = MD_CLASSES_MULTI;
    } else if (width == 1) {
        c.kind = probs || c.logits ? MD_CLASSES_BINARY : MD_CLASSES_NONE;
        c.classes = c.kind == MD_CLASSES_BINARY ? 2 : 0;
    }
    return c;
}

const char *md_classes_none_reason(void)
{
    return "the model has one output column and its config does not say what it is: declare "
           "\"output\": \"probabilities\" (a sigmoid: class 1 above 0.5) or \"output\": "
           "\"logits\" (class 1 above 0), and \"threshold\" for another cut";
}

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

void md_classes_probs(const md_classes *c, const float *y, float *p)
{
    switch (c->kind) {
    case MD_CLASSES_BINARY: {
        double p1 = c->logits ? sigmoid(y[0]) : (double)y[0];
        p[0] = (float)(1.0 - p1);
        p[1] = (float)p1;
        return;
    }
    case MD_CLASSES_MULTI:
        for (int64_t j = 0; j < c->width; j++)
            p[j] = c->logits ? (float)sigmoid(y[j]) : y[j];
        return;
    case MD_CLASSES_ARGMAX:
        if (c->logits && c->width > 0) {
            float mx = y[0];
            for (int64_t j = 1; j < c->width; j++)
                mx = y[j] > mx ? y[j] : mx;
            double sum = 0;
            for (int64_t j = 0; j < c->width; j++)
                sum += (p[j] = expf(y[j] - mx));
            for (int64_t j = 0; j < c->width; j++)
                p[j] = (float)(p[j] / sum);
        } else if (c->width > 0) {
            memcpy(p, y, sizeof(float) * (size_t)c->width);
        }
        return;
    case MD_CLASSES_NONE:
        return;
    }
}

int64_t md_classes_top(const md_classes *c, const float *y)
{
    int64_t best = 0;
    switch (c->kind) {
    case MD_CLASSES_BINARY:
        return (double)y[0] > c->cut;
    case MD_CLASSES_ARGMAX:
        md_top_k(y, c->width, 1, &best);
        return best;
    default:
        return -1;
    }
}

int md_classes_present(const md_classes *c, const float *y, int64_t j)
{
    return c->kind == MD_CLASSES_MULTI && (double)y[j] > c->cut;
}

int64_t md_classes_top_k(const md_classes *c, const float *y, int64_t k, float *p, int64_t *idx,
                         float *score)
{
    if (c->kind == MD_CLASSES_NONE || k <= 0)
        return 0;
    md_classes_probs(c, y, p);
    if (k > c->classes)
        k = c->classes;
    if (c->kind == MD_CLASSES_BINARY) {
        idx[0] = md_classes_top(c, y);
        if (k > 1)
            idx[1] = 1 - idx[0];
    } else {
        /* ranked on the values: softmax and sigmoid keep their order, and
         * the values do not round two near classes into a tie */
        k = md_top_k(y, c->width, k, idx);
    }
    for (int64_t t = 0; t < k; t++)
        score[t] = p[idx[t]];
    return k;
}
