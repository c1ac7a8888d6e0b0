/*
 * pbcall.h: one unary gRPC call with protobuf-c messages on both ends.
 *
 * Packs `req`, calls `method` through common/rpc.c with a deadline and
 * unpacks the reply with `reply_desc`. Returns 0 with *reply set (free it
 * with protobuf_c_message_free_unpacked), or -1 with the gRPC status in
 * *status (when not NULL; ZT_RPC_INTERNAL for a reply that does not decode)
 * and a message naming the method. Used by zworker, zctl and the tools.
 */
#ifndef ZT_PBCALL_H
#define ZT_PBCALL_H

#include <protobuf-c/protobuf-c.h>
#include <stdint.h>

#include "zt_rpc.h"

ZT_MUST_CHECK int zt_pb_call(zt_rpc_client_t *c, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *reply_desc, int64_t timeout_ms,
               ProtobufCMessage **reply, int *status);

#endif
