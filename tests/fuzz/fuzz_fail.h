/*
 * fuzz_fail.h: how a fuzz target reports a broken property.
 *
 * ZT_FUZZ_FAIL() prints the target's file and line to stderr and aborts,
 * which libFuzzer reports as a deadly signal and keeps the input for. The
 * line is what tests/fuzz/run shows in its summary, so a failure in CI
 * says which property broke without the input at hand.
 */
#ifndef ZT_FUZZ_FAIL_H
#define ZT_FUZZ_FAIL_H

#include <stdio.h>
#include <stdlib.h>

#define ZT_FUZZ_FAIL()                                                               \
  (fprintf(stderr, "fuzz property failed at %s:%d\n", __FILE__, __LINE__), abort())

#endif
