/*
 * pbcall.c: see pbcall.h.
 */
#include <stdlib.h>

#include "pbcall.h"
#include "zt_common.h"

int zt_pb_call(zt_rpc_client_t *c, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *reply_desc, int64_t timeout_ms,
               ProtobufCMessage **reply, int *status) {
  size_t n = protobuf_c_message_get_packed_size(req);
  uint8_t stackbuf[1024];
  uint8_t *buf = n <= sizeof stackbuf ? stackbuf : zt_xmalloc(n);
  protobuf_c_message_pack(req, buf);
  uint8_t *resp = NULL;
  size_t rlen = 0;
  int st = 0;
  int rc = zt_rpc_call(c, method, buf, n, timeout_ms, &resp, &rlen, &st);
  if (buf != stackbuf) free(buf);
  if (status) *status = st;
  if (rc != 0) return -1;
  *reply = protobuf_c_message_unpack(reply_desc, NULL, rlen, resp);
  free(resp);
  if (!*reply) {
    if (status) *status = ZT_RPC_INTERNAL;
    return zt_err("%s: reply is not a valid %s", method, reply_desc->name);
  }
  return 0;
}
