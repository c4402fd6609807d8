/* One row's update for each optimizer: gradient clip, decoupled decay, the optimizer, weight clip, in float32
 * in the torch reference's operation order (kernels/<optimizer>.py); et_row_function picks one by kind. */
#include "embtables_native.h"

/* ------------------------------------------------------------------------------------------ */
/* Per-row optimizer pipeline: gradient clip -> decoupled decay -> optimizer -> weight clip.    */
/* One function per optimizer so each element loop vectorises; absent clip bounds are +-inf.    */

#define ET_PROLOGUE                                                                                                \
    float g = gin ? gin[d] : 0.0f;                                                                                 \
    g = g < p->glo ? p->glo : g;                                                                                   \
    g = g > p->ghi ? p->ghi : g;                                                                                   \
    float x = w[d];                                                                                                \
    x = x - p->decay * x;
#define ET_EPILOGUE                                                                                                \
    x = x < p->wlo ? p->wlo : x;                                                                                   \
    x = x > p->whi ? p->whi : x;                                                                                   \
    w[d] = x;

static void et_row_sgd(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1, float *restrict s2,
                       const float *restrict gin, int64_t D) {
    (void)s0;
    (void)s1;
    (void)s2;
    const float lr = p->lr;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        x = x - lr * g;
        ET_EPILOGUE
    }
}

static void et_row_adagrad(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1, float *restrict s2,
                           const float *restrict gin, int64_t D) {
    (void)s1;
    (void)s2;
    const float lr = p->lr;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float a = s0[d] + g * g;
        s0[d] = a;
        x = x - lr * g / sqrtf(a);
        ET_EPILOGUE
    }
}

static void et_row_adagrad_momentum(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1, float *restrict s2,
                                    const float *restrict gin, int64_t D) {
    (void)s2;
    const float lr = p->lr;
    const float mom = p->k.adagrad_momentum.momentum, pw = p->k.adagrad_momentum.neg_inv_exponent;
    const float b2 = p->k.adagrad_momentum.beta2, one_minus_b2 = p->k.adagrad_momentum.one_minus_beta2;
    const float eps = p->k.adagrad_momentum.epsilon;
    const int nesterov = p->f.adagrad_momentum.use_nesterov, sum = p->f.adagrad_momentum.beta2_is_one;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float a = sum ? s0[d] + g * g : b2 * s0[d] + one_minus_b2 * (g * g);
        const float scaled = powf(a + eps, pw) * g;
        const float m = mom * s1[d] + scaled;
        s0[d] = a;
        s1[d] = m;
        x = x - lr * (nesterov ? mom * m + scaled : m);
        ET_EPILOGUE
    }
}

static void et_row_adam(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1, float *restrict s2,
                        const float *restrict gin, int64_t D) {
    (void)s2;
    const float lr = p->lr;
    const float b1 = p->k.adam.beta_1, one_minus_b1 = p->k.adam.one_minus_beta_1;
    const float b2 = p->k.adam.beta_2, one_minus_b2 = p->k.adam.one_minus_beta_2;
    const float eps2 = p->k.adam.epsilon_squared, eps = p->k.adam.epsilon;
    const int inside = p->f.adam.sum_inside_sqrt;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float m = b1 * s0[d] + one_minus_b1 * g;
        const float v = b2 * s1[d] + one_minus_b2 * (g * g);
        s0[d] = m;
        s1[d] = v;
        const float den = inside ? sqrtf(v + eps2) : sqrtf(v) + eps;
        x = x - lr * m / den;
        ET_EPILOGUE
    }
}

/* The FTRL element loop, with the accumulator power POW(n) as a macro so that the default
 * learning_rate_power = -0.5 gets a sqrt loop the compiler vectorises instead of a powf call. */
#define ET_FTRL_LOOP(POW)                                                                                          \
    for (int64_t d = 0; d < D; ++d) {                                                                              \
        ET_PROLOGUE                                                                                                \
        const float n = s0[d];                                                                                     \
        const float nn = n + g * g;                                                                                \
        const float pw_new = (allow_zero && nn == 0.0f) ? 0.0f : POW(nn);                                          \
        const float pw_old = (allow_zero && n == 0.0f) ? 0.0f : POW(n);                                            \
        const float delta = pw_new - pw_old;                                                                       \
        float z = s1[d], den;                                                                                      \
        if (multiply_linear) {                                                                                     \
            z = z + lr * g - delta * x;                                                                            \
            den = pw_new + two_l2 + beta;                                                                          \
        } else {                                                                                                   \
            z = z + g - (delta / lr) * x;                                                                          \
            den = (pw_new + beta) / lr + two_l2;                                                                   \
        }                                                                                                          \
        const float numer = (z < -lim ? -lim : (z > lim ? lim : z)) - z;                                           \
        s0[d] = nn;                                                                                                \
        s1[d] = z;                                                                                                 \
        x = (allow_zero && numer == 0.0f) ? 0.0f : numer / den;                                                    \
        ET_EPILOGUE                                                                                                \
    }

#define ET_SQRT(v) sqrtf(v)
#define ET_POWF(v) powf((v), e)

/* power = -learning_rate_power; l1 and two_l2 are lr*l1 and 2*lr*l2 when multiply_linear_by_learning_rate */
static void et_row_ftrl(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1, float *restrict s2,
                        const float *restrict gin, int64_t D) {
    (void)s2;
    const float lr = p->lr, lim = p->k.ftrl.l1, e = p->k.ftrl.power, beta = p->k.ftrl.beta, two_l2 = p->k.ftrl.two_l2;
    const int allow_zero = p->f.ftrl.allow_zero_accumulator, multiply_linear = p->f.ftrl.multiply_linear_by_learning_rate;
    if (e == 0.5f) {
        ET_FTRL_LOOP(ET_SQRT)
    } else {
        ET_FTRL_LOOP(ET_POWF)
    }
}

/* sign(p) max(|p| - lr_t l1, 0) / (1 + lr_t l2), as kernels/proximal_adagrad.py computes it */
static inline float et_proximal(float prox, float lr_t, float l1, float l2) {
    float sh = fabsf(prox) - lr_t * l1;
    sh = sh < 0.0f ? 0.0f : sh;
    /* sign(prox) * sh: copysign is exact for prox != 0; prox == 0 gives sh == 0 (l1 >= 0), a zero either way */
    return copysignf(sh, prox) / (1.0f + lr_t * l2);
}

static void et_row_proximal_adagrad(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1,
                                    float *restrict s2, const float *restrict gin, int64_t D) {
    (void)s1;
    (void)s2;
    const float lr = p->lr;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float a = s0[d] + g * g;
        s0[d] = a;
        const float lr_t = lr / sqrtf(a);
        x = et_proximal(x - lr_t * g, lr_t, p->k.proximal_adagrad.l1, p->k.proximal_adagrad.l2);
        ET_EPILOGUE
    }
}

static void et_row_momentum(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1,
                            float *restrict s2, const float *restrict gin, int64_t D) {
    (void)s1;
    (void)s2;
    const float lr = p->lr, mom = p->k.momentum.momentum;
    const int nesterov = p->f.momentum.use_nesterov;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float m = mom * s0[d] + g;
        s0[d] = m;
        x = x - lr * (nesterov ? g + mom * m : m);
        ET_EPILOGUE
    }
}

/* RMSProp and, for kind ET_CENTERED_RMSPROP, centered RMSProp (s2 = mg). One loop per variant so each vectorises. */
static void et_row_rmsprop(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1,
                           float *restrict s2, const float *restrict gin, int64_t D) {
    const float lr = p->lr, rho = p->k.rmsprop.rho, one_minus_rho = p->k.rmsprop.one_minus_rho;
    const float momentum = p->k.rmsprop.momentum, eps = p->k.rmsprop.epsilon;
    if (p->kind == ET_CENTERED_RMSPROP) {
        for (int64_t d = 0; d < D; ++d) {
            ET_PROLOGUE
            const float ms = rho * s0[d] + one_minus_rho * (g * g);
            const float mg = rho * s2[d] + one_minus_rho * g;
            const float mom = momentum * s1[d] + lr * g / sqrtf(ms - mg * mg + eps);
            s0[d] = ms;
            s1[d] = mom;
            s2[d] = mg;
            x = x - mom;
            ET_EPILOGUE
        }
    } else {
        for (int64_t d = 0; d < D; ++d) {
            ET_PROLOGUE
            const float ms = rho * s0[d] + one_minus_rho * (g * g);
            const float mom = momentum * s1[d] + lr * g / sqrtf(ms + eps);
            s0[d] = ms;
            s1[d] = mom;
            x = x - mom;
            ET_EPILOGUE
        }
    }
}

static void et_row_adadelta(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1,
                            float *restrict s2, const float *restrict gin, int64_t D) {
    (void)s2;
    const float lr = p->lr, rho = p->k.adadelta.rho, one_minus_rho = p->k.adadelta.one_minus_rho;
    const float eps = p->k.adadelta.epsilon;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float a = rho * s0[d] + one_minus_rho * (g * g);
        const float u = sqrtf(s1[d] + eps) / sqrtf(a + eps) * g;
        s0[d] = a;
        s1[d] = rho * s1[d] + one_minus_rho * (u * u);
        x = x - lr * u;
        ET_EPILOGUE
    }
}

/* s0 v, s1 m */
static void et_row_proximal_yogi(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1,
                                 float *restrict s2, const float *restrict gin, int64_t D) {
    (void)s2;
    const float lr = p->lr, b1 = p->k.proximal_yogi.beta_1, one_minus_b1 = p->k.proximal_yogi.one_minus_beta_1;
    const float one_minus_b2 = p->k.proximal_yogi.one_minus_beta_2, eps = p->k.proximal_yogi.epsilon;
    const float l1 = p->k.proximal_yogi.l1, l2 = p->k.proximal_yogi.l2;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        const float g2 = g * g;
        const float m = b1 * s1[d] + one_minus_b1 * g;
        const float v0 = s0[d], diff = v0 - g2, step = one_minus_b2 * g2; /* (1-b2) * sign(diff) * g^2 */
        /* every arm computed first, then selected: straight-line code the compiler vectorises */
        const float down = v0 - step, up = v0 + step, same = v0 - 0.0f * g2;
        const float v = diff > 0.0f ? down : (diff < 0.0f ? up : same);
        s0[d] = v;
        s1[d] = m;
        const float lr_t = lr / (sqrtf(v) + eps);
        x = et_proximal(x - lr_t * m, lr_t, l1, l2);
        ET_EPILOGUE
    }
}

/* lr = the global step t; s0 last_hit_step */
static void et_row_frequency_estimator(const et_opt *p, float *restrict w, float *restrict s0, float *restrict s1,
                                       float *restrict s2, const float *restrict gin, int64_t D) {
    (void)s1;
    (void)s2;
    const float t = p->lr, max_delta = p->k.frequency_estimator.max_delta;
    const float one_minus_tau = p->k.frequency_estimator.one_minus_tau, tau = p->k.frequency_estimator.tau;
    const float outlier = p->k.frequency_estimator.outlier_threshold;
    for (int64_t d = 0; d < D; ++d) {
        ET_PROLOGUE
        (void)g;
        const float delta = t - s0[d];
        const float dc = delta > max_delta ? max_delta : delta;
        const float smoothed = x * one_minus_tau + dc * tau, threshold = outlier * x;
        x = delta >= threshold ? dc : smoothed;
        s0[d] = t;
        ET_EPILOGUE
    }
}

et_row_fn et_row_function(int kind) {
    switch (kind) {
    case ET_SGD: return et_row_sgd;
    case ET_ADAGRAD: return et_row_adagrad;
    case ET_ADAGRAD_MOMENTUM: return et_row_adagrad_momentum;
    case ET_ADAM: return et_row_adam;
    case ET_PROXIMAL_ADAGRAD: return et_row_proximal_adagrad;
    case ET_MOMENTUM: return et_row_momentum;
    case ET_RMSPROP: return et_row_rmsprop;
    case ET_CENTERED_RMSPROP: return et_row_rmsprop;
    case ET_ADADELTA: return et_row_adadelta;
    case ET_PROXIMAL_YOGI: return et_row_proximal_yogi;
    case ET_FREQUENCY_ESTIMATOR: return et_row_frequency_estimator;
    case ET_FTRL: return et_row_ftrl;
    default: return NULL; /* a kind this file does not know: every caller refuses it (-4 / 4) */
    }
}
