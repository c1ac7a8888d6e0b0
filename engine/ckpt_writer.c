/*
 * ckpt_writer.c: the thread that writes checkpoint epochs while training
 * goes on (see ckpt_io.h).
 *
 * The training thread and the writer share one slot under a mutex: `busy`
 * is set when an epoch is handed over and cleared when its files are
 * durable (or the write failed). The training thread never waits for disk
 * unless it wants to hand over the next epoch while one is still being
 * written.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_io.h"
#include "zt_common.h"

struct zt_ckpt_writer {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int busy, quit; /* under mu */
  int written;     /* under mu: its write ended (durable or failed); done() runs */
  int64_t reporting_step;
  zt_ckpt_done_fn done;
  void *user;
  /* The epoch in flight (owned by the writer thread while busy). */
  char dir[ZT_PATH_MAX];
  zt_ckpt_meta_t meta;
  zt_range_t skips[ZT_MAX_SKIP_RANGES];
  zt_ckpt_range_t *rg;
  int nr, rg_cap;
  float *buf;
  size_t buf_cap;
};

/* Writes one epoch and reports it; returns the result of the write. */
static int write_one(zt_ckpt_writer_t *w) {
  zt_ckpt_file_t files[4];
  int nf = 0;
  int64_t t0 = zt_now_ms();
  const char *error = NULL;
  char err[512];
  if (zt_ckpt_write(w->dir, &w->meta, w->rg, w->nr, files, &nf) != 0) {
    snprintf(err, sizeof err, "%s", zt_err_msg());
    error = err;
    ZT_ERROR("checkpoint step %lld not written: %s", (long long)w->meta.step, error);
  } else {
    ZT_INFO("checkpoint step %lld written in %lld ms: %s", (long long)w->meta.step,
            (long long)(zt_now_ms() - t0), w->dir);
  }
  pthread_mutex_lock(&w->mu);
  w->written = 1;
  w->reporting_step = w->meta.step;
  pthread_cond_broadcast(&w->cv); /* zt_ckpt_writer_reporting waits for this */
  pthread_mutex_unlock(&w->mu);
  if (w->done && w->done(w->user, w->meta.step, w->dir, error ? NULL : files, error ? 0 : nf,
                         error) != 0)
    ZT_WARN("checkpoint step %lld: the report was not taken by the coordinator",
            (long long)w->meta.step);
  return error ? -1 : 0;
}

static void *writer_main(void *p) {
  zt_ckpt_writer_t *w = p;
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (!w->busy && !w->quit) pthread_cond_wait(&w->cv, &w->mu);
    if (!w->busy) break;
    pthread_mutex_unlock(&w->mu);
    (void)write_one(w); /* a failure was reported; the next epoch is tried */
    pthread_mutex_lock(&w->mu);
    w->busy = 0;
    w->written = 0;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

int zt_ckpt_writer_start(zt_ckpt_done_fn done, void *user, zt_ckpt_writer_t **out) {
  zt_ckpt_writer_t *w = zt_xcalloc(1, sizeof *w);
  w->done = done;
  w->user = user;
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  if (pthread_create(&w->th, NULL, writer_main, w) != 0) {
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
    return zt_err("cannot start the checkpoint writer thread");
  }
  *out = w;
  return 0;
}

int64_t zt_ckpt_writer_reporting(zt_ckpt_writer_t *w) {
  pthread_mutex_lock(&w->mu);
  while (w->busy && !w->written) pthread_cond_wait(&w->cv, &w->mu);
  int64_t step = w->busy ? w->reporting_step : 0;
  pthread_mutex_unlock(&w->mu);
  return step;
}

float *zt_ckpt_writer_buffer(zt_ckpt_writer_t *w, size_t nfloats) {
  pthread_mutex_lock(&w->mu);
  while (w->busy) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
  if (nfloats > w->buf_cap) {
    free(w->buf);
    w->buf = zt_xmalloc(nfloats * sizeof(float));
    w->buf_cap = nfloats;
  }
  return w->buf;
}

int zt_ckpt_writer_submit(zt_ckpt_writer_t *w, const char *dir, const zt_ckpt_meta_t *meta,
                          const zt_ckpt_range_t *ranges, int nranges) {
  if (snprintf(w->dir, sizeof w->dir, "%s", dir) >= (int)sizeof w->dir)
    return zt_err("checkpoint directory name too long: %.64s...", dir);
  if (meta->nskips > ZT_MAX_SKIP_RANGES)
    return zt_err("checkpoint: %d skip ranges (the limit is %d)", meta->nskips,
                  ZT_MAX_SKIP_RANGES);
  if (nranges > w->rg_cap) {
    w->rg = zt_xrealloc(w->rg, (size_t)nranges * sizeof *w->rg);
    w->rg_cap = nranges;
  }
  memcpy(w->rg, ranges, (size_t)nranges * sizeof *w->rg);
  w->nr = nranges;
  if (meta->nskips > 0) /* skips may be NULL without any */
    memcpy(w->skips, meta->skips, (size_t)meta->nskips * sizeof *w->skips);
  w->meta = *meta;
  w->meta.skips = w->skips;
  pthread_mutex_lock(&w->mu);
  w->busy = 1;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return 0;
}

void zt_ckpt_writer_stop(zt_ckpt_writer_t *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->quit = 1; /* the loop finishes an epoch in flight first */
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->th, NULL);
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w->rg);
  free(w->buf);
  free(w);
}
