/*
 * ckpt_io.h: sharded checkpoint files on disk (the worker side).
 *
 * An epoch is a directory `<dir>/job_<id>/step_<SSSSSSSS>-g<gen>/` holding,
 * for each rank r of the generation that wrote it:
 *
 *   rank_<r>.bin   for every unit u, the elements [lo, lo+n) of the unit's
 *                  logical buffer that rank r owned (its ZeRO shard, clipped
 *                  to the unit's real size): n params (fp32 master), then
 *                  n Adam m, then n Adam v
 *   rank_<r>.json  the list of (unit, lo, n, file offset), the file's size
 *                  and its xxh64 checksum
 *
 * and, from rank 0, `manifest.json` with the model config, step, world size,
 * ZeRO stage, data cursor, skip ranges, seed and learning-rate state. Every
 * file is written as `<name>.tmp`, fsynced, renamed, and the directory
 * fsynced, so a crash leaves either the old state or the new file, never a
 * torn one; the coordinator commits the epoch only when every rank reported.
 *
 * Every file is reported with its size and xxh64 checksum, and the
 * coordinator records them when it commits the epoch. Loading is given that
 * record and verifies every byte it depends on before using any: the
 * manifest and each rank's index are read into memory and checked against
 * it, each .bin against both the record and its index; a file that is
 * missing, extra, truncated or changed is an error naming the file
 * ("corrupt checkpoint"). Then the ranges the new rank needs are copied,
 * whatever world size or stage wrote them: resharding is just a range
 * intersection. Each index must be its rank's of the manifest's world and
 * step, and the ranks' ranges must hold every element wanted exactly once
 * (none missing, none overlapping), else the load fails the same way.
 */
#ifndef ZT_CKPT_IO_H
#define ZT_CKPT_IO_H

#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "zt_common.h"

/* One unit range held in memory for writing. */
typedef struct {
  int unit;
  uint64_t lo, n;
  const float *p, *m, *v;
} zt_ckpt_range_t;

typedef struct {
  uint64_t job_id, generation;
  int64_t step;
  int rank, world, stage;
  zt_model_config_t model;
  uint64_t seed;
  int64_t global_batch;
  const zt_range_t *skips;
  int nskips;
  /* The tokenizer record of the job's data (absolute path), or "": the
   * manifest names it so that export and sampling find the tokenizer. */
  char tokenizer[ZT_PATH_MAX];
  /* LoRA (model.lora_r > 0): the base model the adapters adapt, as the
   * spec names it, and the XXH64 of its fp32 parameters (lora.h). */
  char lora_base[ZT_PATH_MAX];
  uint64_t lora_base_hash;
  /* DiLoCo (sync.mode "diloco", diloco.h): the groups that wrote the
   * epoch, the model's units and the inner steps of a round; 0 groups:
   * not DiLoCo. */
  int diloco_groups, diloco_units, diloco_ef;
  int64_t diloco_inner_steps;
} zt_ckpt_meta_t;

typedef struct {
  char name[64];
  uint64_t bytes;
  char checksum[32]; /* "xxh64:<16 hex>" */
} zt_ckpt_file_t;

/* The files one rank writes: rank_<r>.bin, rank_<r>.json and, on rank 0,
 * manifest.json. */
#define ZT_CKPT_FILES_PER_RANK 3

/* Writes this rank's files (and the manifest on rank 0) into `dir`;
 * returns the files written (at most 3) with their sizes and checksums in
 * files/nfiles. */
ZT_MUST_CHECK int zt_ckpt_write(const char *dir, const zt_ckpt_meta_t *meta, const zt_ckpt_range_t *ranges,
                  int nranges, zt_ckpt_file_t *files, int *nfiles);

/* A destination for loading: unit u's elements [lo, lo+n) go to p, m, v
 * (any may be NULL). */
typedef struct {
  int unit;
  uint64_t lo, n;
  float *p, *m, *v;
} zt_ckpt_dest_t;

/* The files of a committed epoch as the coordinator recorded them. With
 * n == 0 (zctl export of an epoch the caller trusts, an epoch committed
 * before checksums were recorded) only the checksums in the indexes are
 * checked. */
typedef struct {
  const zt_ckpt_file_t *files;
  int n;
} zt_ckpt_record_t;

/* Loads the ranges of `dest` from the epoch in `dir`, verified against
 * `rec` first; checks the model config. *step receives the epoch's step. */
ZT_MUST_CHECK int zt_ckpt_load(const char *dir, const zt_model_config_t *model,
                               const zt_ckpt_dest_t *dest, int ndest, const zt_ckpt_record_t *rec,
                               int64_t *step);

/* The model config in the manifest of the epoch in `dir` (checked with
 * zt_model_config_check, so within the ZT_MODEL_MAX_* limits); when
 * tokenizer is not NULL, it receives the tokenizer record the manifest
 * names ("" when none; cap bytes). Export and sampling read an epoch with
 * it and zt_ckpt_load_flat. */
ZT_MUST_CHECK int zt_ckpt_read_model(const char *dir, zt_model_config_t *cfg, char *tokenizer,
                                     size_t cap);

/* A LoRA epoch's base model (manifest.json's lora_base): its path and the
 * checksum text ("xxh64:<16 hex>") of its fp32 parameters. */
ZT_MUST_CHECK int zt_ckpt_read_lora_base(const char *dir, char *path, size_t cap, char sum[32]);

/* Every parameter of the epoch in `dir` in one flat buffer laid out as
 * *lay (built here from cfg; zt_layout_free it): unit destinations over
 * zt_ckpt_load with no record (the indexes' checksums are checked). A
 * model larger than the rank files can hold is refused before its buffer
 * is allocated. *flat is host memory (free it); *step the epoch's step. */
ZT_MUST_CHECK int zt_ckpt_load_flat(const char *dir, const zt_model_config_t *cfg,
                                    zt_layout_t *lay, float **flat, int64_t *step);

/* A DiLoCo epoch's groups and units, and whether it holds each group's
 * error feedback (manifest.json's diloco), verified against rec when it
 * holds files; *groups 0 for an epoch of any other kind. */
ZT_MUST_CHECK int zt_ckpt_read_diloco(const char *dir, const zt_ckpt_record_t *rec, int *groups,
                                      int *units, int *ef);

/* Checks that the file at path has `bytes` bytes and xxh64 `want`
 * ("xxh64:..."); -1 naming the file otherwise ("corrupt checkpoint"). */
ZT_MUST_CHECK int zt_ckpt_verify_file(const char *path, uint64_t bytes, const char *want);

/* 1 when s is a checksum of the form "xxh64:<16 lower-case hex digits>". */
int zt_ckpt_checksum_valid(const char *s);
/* That form of an XXH64 hash. */
void zt_ckpt_checksum_text(char out[32], uint64_t hash);
/* fsyncs a directory, so that a file just renamed into it stays there
 * after a crash. */
ZT_MUST_CHECK int zt_ckpt_fsync_dir(const char *dir);

/* The epoch directory name for (root, job, step, generation). */
void zt_ckpt_dirname(char *buf, size_t n, const char *root, uint64_t job, int64_t step,
                     uint64_t gen);

/* ---- the asynchronous writer (ckpt_writer.c) -------------------------------
 *
 * The training thread snapshots its owned ranges into the writer's host
 * buffer (a copy) and hands them over; the writer thread writes, fsyncs,
 * renames and then calls `done` (the report to the coordinator) while
 * training goes on. One epoch is in flight at a time: zt_ckpt_writer_buffer
 * first waits for the previous write to finish.
 *
 * A write that fails (disk full, a read-only or uncreatable directory)
 * removes this rank's files of the epoch and is reported through `done`
 * with its error: a failed epoch never commits, and training goes on, so
 * the coordinator decides how long a run may go without checkpoints. The
 * next epoch is tried as usual. */

typedef struct zt_ckpt_writer zt_ckpt_writer_t;

/* Called on the writer thread once an epoch's files are durable (error
 * NULL) or its write failed (files NULL, error says why); returns 0 when
 * the coordinator took the report. */
typedef int (*zt_ckpt_done_fn)(void *user, int64_t step, const char *dir,
                               const zt_ckpt_file_t *files, int nfiles, const char *error);

ZT_MUST_CHECK int zt_ckpt_writer_start(zt_ckpt_done_fn done, void *user, zt_ckpt_writer_t **out);
/* The step of the epoch in flight once its write has ended and it is
 * being copied and reported (a slow link, the coordinator out of reach),
 * which can take long; 0 when none is in flight. Waits for the write
 * itself (the disk), as the next epoch's buffer would: a caller that skips
 * an epoch while the previous one is reported must not wait for the
 * report. */
int64_t zt_ckpt_writer_reporting(zt_ckpt_writer_t *w);
/* Waits for the write in flight; returns a host buffer of at least nfloats
 * floats. */
float *zt_ckpt_writer_buffer(zt_ckpt_writer_t *w, size_t nfloats);
/* Hands over the epoch: `ranges` point into the buffer; meta, ranges and the
 * skip ranges are copied. */
ZT_MUST_CHECK int zt_ckpt_writer_submit(zt_ckpt_writer_t *w, const char *dir, const zt_ckpt_meta_t *meta,
                          const zt_ckpt_range_t *ranges, int nranges);
/* Lets a write in flight finish (its epoch may still commit), then stops
 * the thread and frees everything. NULL is ignored. */
void zt_ckpt_writer_stop(zt_ckpt_writer_t *w);

#endif
