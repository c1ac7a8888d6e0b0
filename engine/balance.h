/*
 * balance.h: the load balance's plans: how a step's K micro-batches are
 * shared among N ranks of measured speeds (trainer.c, load_balance.mode
 * "speed"; docs/engine.md, "Work shared by speed").
 *
 * Pure functions of their inputs: every rank computes the same plan from
 * the same all-reduced numbers, so the ranks agree without another message.
 *
 * Two cost models, by ZeRO stage:
 *   stages 0-1  the ranks compute their micro-batches independently and
 *               meet once a step: a step lasts as long as its slowest rank,
 *               max_i share_i / speed_i.
 *   stages 2-3  the ranks reduce (and stage 3 gathers) unit by unit in
 *               every micro-step, so they run in lockstep rounds: round j
 *               lasts as long as the slowest rank that computes a
 *               micro-batch in it, and a step is the sum of its rounds.
 */
#ifndef ZT_BALANCE_H
#define ZT_BALANCE_H

/* The most ranks a plan is for (elastic.max_workers' limit). */
#define ZT_LB_MAX_RANKS 256

/* share[0..N) of K >= N micro-batches for ranks of speed[i] > 0
 * micro-batches per ms, each at least one, summing to K:
 *   independent  one each, the rest in proportion to speed, the last few
 *                each to the rank that would finish it first (the least
 *                maximum; zt_balance_ms);
 *   lockstep     with the ranks ordered fastest first (times t_0 <= t_1
 *                <= ...), a micro-batch given to each of the q + 1 fastest
 *                costs t_q / (q + 1); so one each, the rest in equal parts
 *                to the group of fastest ranks with the least t_q / (q + 1)
 *                (ties: the larger group), the last few one each to the
 *                fastest. */
void zt_balance_plan(int K, int N, const double *speed, int lockstep, int *share);

/* A step's compute time in ms under share[0..N), by the cost model. */
double zt_balance_ms(int N, const int *share, const double *speed, int lockstep);

#endif
