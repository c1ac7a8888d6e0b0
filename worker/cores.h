/*
 * cores.h: the compute threads of a machine's CPU workers, against the
 * cores they may use (cores.c).
 */
#ifndef ZT_CORES_H
#define ZT_CORES_H

/* Says, for as long as this process lives, that it runs `threads` compute
 * threads on this machine (a CPU worker). -1 with a message when it
 * cannot be said (the check then counts only the others). */
int zt_cores_announce(int threads);

/* Warns when the compute threads of the workers this one sees on its
 * machine exceed the cores it may use (zt_cpus_usable()); says so again
 * only when the sum changes. Returns the sum (0 when none is seen). */
int zt_cores_check(void);

#endif
