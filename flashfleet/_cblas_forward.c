/* cblas_sgemm, cblas_dgemm and cblas_cgemm under their usual names, forwarding to the OpenBLAS
 * of the `scipy-openblas32` wheel, which exports them with a `scipy_` prefix only.
 *
 * MLX's Linux CPU wheel calls these three through its reference BLAS. flashfleet/blas.py preloads
 * that wheel's library and then this one (LD_PRELOAD="libscipy_openblas.so:<this>"), so MLX's
 * calls resolve here first and run in OpenBLAS. The scipy_ symbols are left undefined in this
 * object: the dynamic loader takes them from the library preloaded before it.
 * Built by setup.py as an optional extension (Linux only); Python never imports it. */

typedef int cblas_enum; /* CBLAS_ORDER, CBLAS_TRANSPOSE: C enums, passed as int */

void scipy_cblas_sgemm(cblas_enum, cblas_enum, cblas_enum, int, int, int, float, const float *, int,
                       const float *, int, float, float *, int);
void scipy_cblas_dgemm(cblas_enum, cblas_enum, cblas_enum, int, int, int, double, const double *, int,
                       const double *, int, double, double *, int);
void scipy_cblas_cgemm(cblas_enum, cblas_enum, cblas_enum, int, int, int, const void *, const void *, int,
                       const void *, int, const void *, void *, int);

void cblas_sgemm(cblas_enum order, cblas_enum trans_a, cblas_enum trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(cblas_enum order, cblas_enum trans_a, cblas_enum trans_b, int m, int n, int k, double alpha,
                 const double *a, int lda, const double *b, int ldb, double beta, double *c, int ldc) {
    scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(cblas_enum order, cblas_enum trans_a, cblas_enum trans_b, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c, int ldc) {
    scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
