/*
 * loopcall.c: run a function on the loop thread and wait for it.
 *
 * libmicrohttpd serves HTTP on its own threads, but coordinator state belongs
 * to the loop. An HTTP handler therefore packages its work as a function,
 * queues it here and blocks until the loop has run it. At shutdown the queue
 * is closed first: waiting callers are released without running, and new
 * ones fail at once, so stopping the HTTP server can never deadlock on a loop
 * that no longer turns.
 */
#include <stdlib.h>

#include "coord.h"

struct zt_loopcall_item {
  void (*fn)(void *);
  void *arg;
  int done, ran;
  pthread_cond_t cv;
  zt_loopcall_item_t *next;
};

static void on_async(uv_async_t *a) {
  zt_loopcall_t *lc = a->data;
  pthread_mutex_lock(&lc->mu);
  zt_loopcall_item_t *it = lc->head;
  lc->head = NULL;
  pthread_mutex_unlock(&lc->mu);
  while (it) {
    zt_loopcall_item_t *next = it->next;
    it->fn(it->arg);
    pthread_mutex_lock(&lc->mu);
    it->done = it->ran = 1;
    pthread_cond_signal(&it->cv);
    pthread_mutex_unlock(&lc->mu);
    it = next;
  }
}

int zt_loopcall_init(uv_loop_t *loop, zt_loopcall_t *lc) {
  pthread_mutex_init(&lc->mu, NULL);
  lc->head = NULL;
  lc->closing = 0;
  lc->async.data = lc;
  return uv_async_init(loop, &lc->async, on_async) == 0 ? 0 : -1;
}

int zt_loopcall_run(zt_loopcall_t *lc, void (*fn)(void *), void *arg) {
  zt_loopcall_item_t it = {.fn = fn, .arg = arg};
  pthread_cond_init(&it.cv, NULL);
  pthread_mutex_lock(&lc->mu);
  if (lc->closing) {
    pthread_mutex_unlock(&lc->mu);
    pthread_cond_destroy(&it.cv);
    return -1;
  }
  it.next = lc->head;
  lc->head = &it;
  uv_async_send(&lc->async);
  while (!it.done) pthread_cond_wait(&it.cv, &lc->mu);
  pthread_mutex_unlock(&lc->mu);
  pthread_cond_destroy(&it.cv);
  return it.ran ? 0 : -1;
}

void zt_loopcall_close(zt_loopcall_t *lc) {
  pthread_mutex_lock(&lc->mu);
  lc->closing = 1;
  for (zt_loopcall_item_t *it = lc->head; it; it = it->next) {
    it->done = 1;
    pthread_cond_signal(&it->cv);
  }
  lc->head = NULL;
  pthread_mutex_unlock(&lc->mu);
  uv_close((uv_handle_t *)&lc->async, NULL);
}
