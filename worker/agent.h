/*
 * agent.h: a machine's heartbeat agent (zworker --heartbeat-agent).
 *
 * A coordinator's load is its workers' heartbeats, one call each per
 * interval. With the agent, the zworkers of one machine hand their
 * heartbeats to one of them, which sends them to the coordinator in one
 * HeartbeatBatch call: the coordinator sees one call a machine per
 * interval instead of one a GPU. Each entry keeps its own worker's
 * credential and gets its own answer, so nothing about a heartbeat's
 * meaning changes (agent.c says how the agent is chosen and replaced).
 */
#ifndef ZT_AGENT_H
#define ZT_AGENT_H

#include <protobuf-c/protobuf-c.h>
#include <stdint.h>

#include "ztrain.pb-c.h"

typedef struct zt_agent zt_agent_t;

/* The agent for `coordinator` (HOST:PORT) on this machine, as this
 * worker's control thread sees it: nothing is connected or bound until
 * the first heartbeat. */
zt_agent_t *zt_agent_open(const char *coordinator);

/* One heartbeat through the machine's agent, which this process becomes
 * when there is none. As zt_pb_call: 0 with *reply (free it with
 * protobuf_c_message_free_unpacked), or -1 with the status the coordinator
 * (or the agent's call to it) gave in *status and the reason in
 * zt_err_msg(). -2 when no agent answered within timeout_ms (it died, or
 * none could be started): the caller sends this heartbeat itself; the
 * next one tries the agent again. */
int zt_agent_heartbeat(zt_agent_t *a, const Ztrain__HeartbeatRequest *req, int64_t timeout_ms,
                       ProtobufCMessage **reply, int *status);

/* Whether this process is the machine's agent now (for its log line). */
int zt_agent_serving(const zt_agent_t *a);

/* Closes the connection and, where this process is the agent, stops it:
 * the other workers' next heartbeats find another. */
void zt_agent_close(zt_agent_t *a);

#endif
