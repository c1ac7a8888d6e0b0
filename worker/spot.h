/*
 * spot.h: cloud preemption notices, read from the instance metadata service.
 *
 * A spot (preemptible) machine learns of its end from its cloud's metadata
 * service before the machine is taken: AWS gives two minutes, GCP and Azure
 * about thirty seconds. zworker --spot-notice starts a watcher thread that
 * polls the service and, when a notice comes, calls on_notice once with a
 * line saying what it read; zworker then drains as on SIGTERM (the
 * coordinator's logbook records the line as the reason it left).
 *
 *   aws    IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds)
 *          for a session token, then GET /latest/meta-data/spot/instance-action
 *          with it: 200 is a notice, 404 none; 401 (expired token) gets a new
 *          token. /latest/meta-data/events/recommendations/rebalance is read
 *          too: a rebalance recommendation is logged once, not drained on.
 *   gcp    GET /computeMetadata/v1/instance/preempted (Metadata-Flavor:
 *          Google): "TRUE" is a notice.
 *   azure  GET /metadata/scheduledevents?api-version=2020-07-01 (Metadata:
 *          true): an event of EventType "Preempt" is a notice; once the
 *          worker has left, zt_spot_ack acknowledges it (POST StartRequests),
 *          so the platform need not wait out the rest of the notice.
 *   auto   tries aws, gcp and azure in turn until one answers in its own
 *          protocol; after three rounds without an answer the machine is
 *          taken for one without a metadata service and the watcher stops.
 *
 * Every request has a deadline (1 s), answers are capped at 64 KiB and
 * parsed defensively, and failures (slow, down, garbage) are backed off
 * (1 s doubling to 60 s), counted and logged with their reason (the first,
 * then every tenth): a broken metadata service never stops training and
 * never makes the watcher spin.
 */
#ifndef ZT_SPOT_H
#define ZT_SPOT_H

#include <stddef.h>

#include "zt_common.h"

typedef enum { ZT_SPOT_OFF, ZT_SPOT_AUTO, ZT_SPOT_AWS, ZT_SPOT_GCP, ZT_SPOT_AZURE } zt_spot_kind_t;

typedef struct zt_spot zt_spot_t;

typedef struct {
  zt_spot_kind_t kind;
  /* The metadata service, "HOST:PORT" (NULL: 169.254.169.254:80). */
  const char *endpoint;
  int poll_ms; /* between checks (0: 1000) */
  void (*on_notice)(void *user, const char *what);
  void *user;
} zt_spot_opts_t;

/* "off", "auto", "aws", "gcp", "azure" -> kind; -1 with a message otherwise. */
ZT_MUST_CHECK int zt_spot_parse(const char *s, zt_spot_kind_t *kind);

/* Starts the watcher thread (nothing for ZT_SPOT_OFF: *out = NULL). */
ZT_MUST_CHECK int zt_spot_start(const zt_spot_opts_t *o, zt_spot_t **out);

/* Acknowledges the notice where the protocol has that (Azure); a no-op
 * otherwise or when no notice came. Bounded by the request deadline. */
void zt_spot_ack(zt_spot_t *s);

/* Stops and joins the thread (NULL is fine). */
void zt_spot_stop(zt_spot_t *s);

#endif
