/*
 * json.c -- the one JSON string escaper (rpc.h) of every program that prints JSON:
 * precondctl's documents (client/format.c) and the benchmark clients' summaries
 * (bench/train.c).
 *
 * Why here: proto/ is the lowest folder that both already use (libprecond is built on it; the
 * benchmark clients reach it through the trainer library), so neither client/ nor bench/
 * depends on the other for 20 lines; precondctl's JSON is the text form of the wire's
 * answers, next to their packed binary form (codec.c). It is its own static library, with no
 * gRPC, so libprecond's network-free half (and its unit tests) can link it alone.
 */
#include "rpc.h"

void rpc_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)(s != NULL ? s : ""); *p; p++) {
    switch (*p) {
      case '"':
        fputs("\\\"", f);
        break;
      case '\\':
        fputs("\\\\", f);
        break;
      case '\n':
        fputs("\\n", f);
        break;
      case '\r':
        fputs("\\r", f);
        break;
      case '\t':
        fputs("\\t", f);
        break;
      default:
        if (*p < 0x20)
          fprintf(f, "\\u%04x", *p);
        else
          fputc(*p, f);
    }
  }
  fputc('"', f);
}
