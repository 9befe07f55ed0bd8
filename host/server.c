/*
 * server.c -- gRPC core plumbing of precondd.
 *
 * One completion queue polled by io_threads threads. Every method has PD_ARMED slots
 * armed with grpc_server_request_registered_call, plus catch-all slots
 * (grpc_server_request_call) that answer unknown methods with UNIMPLEMENTED instead of
 * leaving them hanging until their deadline. A slot's life:
 *   armed (phase 0) -> new call: re-arm a fresh slot for the method, check the deadline
 *   and the token; a call refused there is answered at once (phase 1) without its message
 *   ever being read, so an unauthenticated client cannot make precondd buffer a large
 *   request; an accepted one asks gRPC for its message (phase 2) -> message received: run
 *   the handler on this poller thread, start one send batch (phase 1) -> batch done:
 *   release the call and free the slot.
 * Handlers only touch the store (short locks) and never wait for a root computation, so
 * running them on the pollers keeps calls short and ordered.
 */
#include "precondd.h"

#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "rpc.h"

#define PD_ARMED     4 /* armed requests per method */
#define PD_ARMED_ANY 2 /* armed catch-all requests */

typedef struct pd_slot {
  pd_server *srv;
  int method; /* pd_method, or -1 for the catch-all */
  int phase;  /* 0: armed; 1: reply batch in flight; 2: receiving the request */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details; /* catch-all only */
  pd_reply reply;
  grpc_slice status_details;
  int counted; /* counted in the server's calls in flight */
} pd_slot;

struct pd_server {
  pd_daemon *d;
  grpc_server *server;
  grpc_completion_queue *cq;
  void *methods[PD_M_COUNT];
  int npollers;
  pthread_t *pollers;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int shutdown_done; /* guarded by lock */
  size_t in_flight;  /* calls started and not yet released; guarded by lock */
  _Atomic int stopping;
  char shutdown_tag; /* its address is the shutdown notification's tag */
};

static void pd__slot_free(pd_slot *s) {
  if (s->counted) {
    pthread_mutex_lock(&s->srv->lock);
    if (--s->srv->in_flight == 0) pthread_cond_broadcast(&s->srv->cond);
    pthread_mutex_unlock(&s->srv->lock);
  }
  if (s->call) grpc_call_unref(s->call);
  if (s->payload) grpc_byte_buffer_destroy(s->payload);
  if (s->reply.payload) grpc_byte_buffer_destroy(s->reply.payload);
  grpc_metadata_array_destroy(&s->md);
  if (s->method < 0) grpc_call_details_destroy(&s->details);
  if (s->phase == 1) grpc_slice_unref(s->status_details);
  free(s);
}

/* Arms one request slot for method m (-1: catch-all). Failing to arm only lowers the
 * number of calls that can start at once; it is logged. */
static void pd__arm(pd_server *srv, int m) {
  if (atomic_load(&srv->stopping)) return;
  pd_slot *s = calloc(1, sizeof *s);
  if (!s) {
    pd_log(PD_LOG_ERROR, "server: out of memory arming a call slot");
    return;
  }
  s->srv = srv;
  s->method = m;
  grpc_metadata_array_init(&s->md);
  grpc_call_error e;
  if (m >= 0) {
    e = grpc_server_request_registered_call(srv->server, srv->methods[m], &s->call, &s->deadline,
                                            &s->md, NULL, srv->cq, srv->cq, s);
  } else {
    grpc_call_details_init(&s->details);
    e = grpc_server_request_call(srv->server, &s->call, &s->details, &s->md, srv->cq, srv->cq, s);
  }
  if (e != GRPC_CALL_OK) {
    if (!atomic_load(&srv->stopping))
      pd_log(PD_LOG_ERROR, "server: arming a call slot failed (grpc_call_error %d)", (int)e);
    pd__slot_free(s);
  }
}

static int pd__slice_eq(grpc_slice s, const char *text) {
  size_t n = strlen(text);
  return GRPC_SLICE_LENGTH(s) == n && memcmp(GRPC_SLICE_START_PTR(s), text, n) == 0;
}

/* 1 if slice s equals text. Takes the same time for every s of the same length, whatever
 * bytes match: the token must not leak through how long a wrong guess takes. */
static int pd__slice_eq_const_time(grpc_slice s, const char *text) {
  size_t n = strlen(text);
  if (GRPC_SLICE_LENGTH(s) != n) return 0;
  const unsigned char *p = GRPC_SLICE_START_PTR(s);
  unsigned char diff = 0;
  for (size_t i = 0; i < n; i++) diff |= (unsigned char)(p[i] ^ (unsigned char)text[i]);
  return diff == 0;
}

/* 1 if the call carries "authorization: Bearer TOKEN" with the configured token. */
static int pd__authorized(const pd_server *srv, const grpc_metadata_array *md) {
  const char *token = srv->d->cfg.token;
  if (!*token) return 1;
  char want[600];
  snprintf(want, sizeof want, "Bearer %s", token);
  int ok = 0;
  for (size_t i = 0; i < md->count; i++)
    if (pd__slice_eq(md->metadata[i].key, "authorization"))
      ok |= pd__slice_eq_const_time(md->metadata[i].value, want);
  return ok;
}

/* Starts the one batch that answers the call with s->reply (phase 1). */
static void pd__send(pd_slot *s) {
  pd_reply *rep = &s->reply;
  grpc_op ops[3];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
  n++;
  if (rep->code == GRPC_STATUS_OK && rep->payload) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = rep->payload;
    n++;
  }
  s->status_details = grpc_slice_from_copied_string(rep->message);
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = rep->code;
  ops[n].data.send_status_from_server.status_details = &s->status_details;
  n++;
  /* The completion may run on another poller before start_batch returns: set the phase
   * first, and do not touch s after a successful start. */
  s->phase = 1;
  grpc_call_error e = grpc_call_start_batch(s->call, ops, n, s, NULL);
  if (e != GRPC_CALL_OK) {
    pd_log(PD_LOG_WARN, "server: sending a reply failed (grpc_call_error %d)", (int)e);
    pd__slot_free(s);
  }
}

/* A new call (phase 0 done): refuses it at once (unknown method, deadline passed, missing
 * or wrong token) or asks gRPC for its message (phase 2). */
static void pd__admit(pd_slot *s) {
  pd_server *srv = s->srv;
  pd_reply *rep = &s->reply;
  rep->code = GRPC_STATUS_OK;
  rep->message[0] = '\0';
  rep->payload = NULL;
  gpr_timespec now = gpr_now(GPR_CLOCK_MONOTONIC);
  gpr_timespec deadline = gpr_convert_clock_type(s->deadline, GPR_CLOCK_MONOTONIC);

  if (s->method < 0) {
    char *name = grpc_slice_to_c_string(s->details.method);
    rep->code = GRPC_STATUS_UNIMPLEMENTED;
    snprintf(rep->message, sizeof rep->message, "method %s is not implemented by precondd", name);
    pd_log(PD_LOG_DEBUG, "unknown method %s", name);
    gpr_free(name);
  } else if (gpr_time_cmp(now, deadline) > 0) {
    rep->code = GRPC_STATUS_DEADLINE_EXCEEDED;
    snprintf(rep->message, sizeof rep->message, "deadline passed before the call started");
  } else if (s->method != PD_M_HEALTH && !pd__authorized(srv, &s->md)) {
    rep->code = GRPC_STATUS_UNAUTHENTICATED;
    snprintf(rep->message, sizeof rep->message,
             "metadata authorization: missing or wrong bearer token");
  }
  if (rep->code != GRPC_STATUS_OK) {
    pd__send(s);
    return;
  }
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &s->payload;
  s->phase = 2;
  grpc_call_error e = grpc_call_start_batch(s->call, &op, 1, s, NULL);
  if (e != GRPC_CALL_OK) {
    pd_log(PD_LOG_WARN, "server: receiving a request failed (grpc_call_error %d)", (int)e);
    pd__slot_free(s);
  }
}

/* The request arrived (phase 2 done; s->payload is NULL when the client sent none): runs
 * the handler and answers. */
static void pd__serve(pd_slot *s) {
  pd_reply *rep = &s->reply;
  pd_service_handle(s->srv->d, (pd_method)s->method, s->payload, rep);
  if (rep->code != GRPC_STATUS_OK)
    pd_log(PD_LOG_DEBUG, "%s: %s: %s", pd_method_paths[s->method], rpc_status_name(rep->code),
           rep->message);
  if (s->payload) {
    grpc_byte_buffer_destroy(s->payload); /* the request is no longer needed */
    s->payload = NULL;
  }
  pd__send(s);
}

static void *pd__poll(void *arg) {
  pd_server *srv = arg;
  pd_thread_name("pd-grpc"); /* tells them apart from MPI's threads in per-thread CPU */
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == &srv->shutdown_tag) {
      pthread_mutex_lock(&srv->lock);
      srv->shutdown_done = 1;
      pthread_cond_broadcast(&srv->cond);
      pthread_mutex_unlock(&srv->lock);
      continue;
    }
    pd_slot *s = ev.tag;
    if (s->phase == 1 || !ev.success) {
      /* A reply sent (or failed: the client went away), a receive that failed, or an armed
       * slot released by the server's shutdown. */
      pd__slot_free(s);
      continue;
    }
    if (s->phase == 2) {
      pd__serve(s);
      continue;
    }
    pthread_mutex_lock(&srv->lock);
    srv->in_flight++;
    s->counted = 1;
    pthread_mutex_unlock(&srv->lock);
    pd__arm(srv, s->method);
    pd__admit(s);
  }
  return NULL;
}

/* 1 if something accepts connections on the unix socket path: gRPC unlinks an existing
 * socket file before binding, which would silently take the path from a running daemon. */
static int pd__unix_in_use(const char *path) {
  struct sockaddr_un sa;
  if (strlen(path) >= sizeof sa.sun_path) return 0;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, path, strlen(path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  int in_use = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
  close(fd);
  return in_use;
}

int pd_server_start(pd_daemon *d, pd_server **out, int *port) {
  *out = NULL;
  *port = 0;
  if (strncmp(d->cfg.listen, "unix:", 5) == 0 && pd__unix_in_use(d->cfg.listen + 5)) {
    pd_log(PD_LOG_ERROR, "cannot listen on %s: another process is accepting connections there",
           d->cfg.listen);
    return PD_EIO;
  }
  pd_server *srv = calloc(1, sizeof *srv);
  if (!srv) return PD_ENOMEM;
  if (pthread_mutex_init(&srv->lock, NULL) != 0) {
    free(srv);
    return PD_ENOMEM;
  }
  if (pthread_cond_init(&srv->cond, NULL) != 0) {
    pthread_mutex_destroy(&srv->lock);
    free(srv);
    return PD_ENOMEM;
  }
  grpc_init();
  srv->d = d;
  /* Size limits, and no SO_REUSEPORT: gRPC sets it by default, which would let a second
   * daemon bind the same port and take half of the connections (and their statistics). */
  rpc_args args; /* and the transport defaults (proto/rpc.c), then --grpc-arg's */
  rpc_args_init(&args, d->cfg.max_message_bytes);
  rpc_args_set_int(&args, GRPC_ARG_ALLOW_REUSEPORT, 0);
  for (int i = 0; i < d->cfg.ngrpc_args; i++)
    if (rpc_args_parse(&args, d->cfg.grpc_args[i]) != RPC_OK)
      pd_log(PD_LOG_WARN, "--grpc-arg %s: not set (at most %d arguments)", d->cfg.grpc_args[i],
             RPC_ARGS_MAX);
  srv->server = grpc_server_create(rpc_args_get(&args), NULL);
  srv->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
  for (int m = 0; m < PD_M_COUNT; m++)
    srv->methods[m] = grpc_server_register_method(srv->server, pd_method_paths[m], NULL,
                                                  GRPC_SRM_PAYLOAD_NONE, 0);
  grpc_server_credentials *creds;
  if (d->cfg.tls_cert) {
    grpc_ssl_pem_key_cert_pair pair = {d->cfg.tls_key, d->cfg.tls_cert};
    creds = grpc_ssl_server_credentials_create(d->cfg.tls_client_ca, &pair, 1,
                                               d->cfg.tls_client_ca != NULL, NULL);
  } else {
    creds = grpc_insecure_server_credentials_create();
  }
  int bound = grpc_server_add_http2_port(srv->server, d->cfg.listen, creds);
  grpc_server_credentials_release(creds);
  if (bound == 0) {
    pd_log(PD_LOG_ERROR, "cannot listen on %s (address in use, bad address or no permission)",
           d->cfg.listen);
    grpc_server_destroy(srv->server);
    grpc_completion_queue_shutdown(srv->cq);
    while (grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(srv->cq);
    pthread_cond_destroy(&srv->cond);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
    grpc_shutdown();
    return PD_EIO;
  }
  *port = strncmp(d->cfg.listen, "unix:", 5) == 0 ? 0 : bound;
  grpc_server_start(srv->server);
  for (int m = 0; m < PD_M_COUNT; m++)
    for (int k = 0; k < PD_ARMED; k++) pd__arm(srv, m);
  for (int k = 0; k < PD_ARMED_ANY; k++) pd__arm(srv, -1);

  int n = d->cfg.io_threads > 0 ? d->cfg.io_threads : 1;
  srv->pollers = calloc((size_t)n, sizeof *srv->pollers);
  for (int i = 0; srv->pollers && i < n; i++) {
    if (pthread_create(&srv->pollers[i], NULL, pd__poll, srv) != 0) break;
    srv->npollers++;
  }
  if (srv->npollers == 0) {
    pd_log(PD_LOG_ERROR, "server: cannot start poller threads");
    *out = srv;
    pd_server_stop(srv, 0);
    *out = NULL;
    return PD_ENOMEM;
  }
  *out = srv;
  return PD_OK;
}

/* Waits until the shutdown notification came, or (when idle_too) no call is in flight, for
 * at most timeout_s (< 0: no limit). Returns the number of calls in flight then (0 when the
 * notification came). With idle_too < 0 it waits for both: the notification can come while
 * a cancelled call's handler still runs and is about to start its reply batch, which must
 * not reach a completion queue already shut down (gRPC asserts). */
static size_t pd__wait_shutdown(pd_server *srv, double timeout_s, int idle_too) {
  pthread_mutex_lock(&srv->lock);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  double t = (double)until.tv_sec + 1e-9 * (double)until.tv_nsec + timeout_s;
  until.tv_sec = (time_t)t;
  until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
  while (idle_too < 0 ? !(srv->shutdown_done && srv->in_flight == 0)
                      : !srv->shutdown_done && !(idle_too && srv->in_flight == 0)) {
    if (timeout_s < 0)
      pthread_cond_wait(&srv->cond, &srv->lock);
    else if (pthread_cond_timedwait(&srv->cond, &srv->lock, &until) != 0)
      break;
  }
  size_t left = srv->shutdown_done ? 0 : srv->in_flight;
  pthread_mutex_unlock(&srv->lock);
  return left;
}

void pd_server_stop(pd_server *srv, double grace_s) {
  if (!srv) return;
  atomic_store(&srv->stopping, 1);
  grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
  if (srv->npollers > 0) {
    /* gRPC's notification also waits for every connection to close, and an idle client
     * keeps its connection: once no call is in flight there is nothing to wait for, and
     * cancelling (which closes the connections) loses nothing. */
    size_t left = pd__wait_shutdown(srv, grace_s, 1);
    if (left > 0)
      pd_log(PD_LOG_WARN, "shutdown: %zu calls still in flight after %.1f s: cancelling them", left,
             grace_s);
    grpc_server_cancel_all_calls(srv->server);
    pd__wait_shutdown(srv, -1, -1);
  } else {
    grpc_server_cancel_all_calls(srv->server);
  }
  grpc_server_destroy(srv->server);
  grpc_completion_queue_shutdown(srv->cq);
  for (int i = 0; i < srv->npollers; i++) pthread_join(srv->pollers[i], NULL);
  if (srv->npollers == 0) {
    /* Nobody polled: drain here so every slot is released. */
    for (;;) {
      grpc_event ev = grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
      if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
      if (ev.type == GRPC_OP_COMPLETE && ev.tag != &srv->shutdown_tag) pd__slot_free(ev.tag);
    }
  }
  grpc_completion_queue_destroy(srv->cq);
  free(srv->pollers);
  pthread_cond_destroy(&srv->cond);
  pthread_mutex_destroy(&srv->lock);
  free(srv);
  grpc_shutdown();
}
