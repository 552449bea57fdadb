// The process's network actor system and node connections (used by troupe's sources and by
// <troupe/testing.hpp>; not included by <troupe/troupe.hpp>).
#pragma once

#include <caf/actor.hpp>
#include <caf/fwd.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "troupe/node.hpp"

namespace troupe::detail {

/// The actor system settings troupe uses: work sharing, CAF's own logging quiet; with
/// `network`, the middleman, troupe's message types and heartbeats; with TLS, CAF's OpenSSL
/// module (key files are validated first: a bad key must not hang the handshake).
std::unique_ptr<caf::actor_system_config> make_system_config(bool network, const tls& t = {});
/// troupe's message types (what crosses the network), registered in `cfg`.
void add_message_types(caf::actor_system_config& cfg);

/// The one actor system that every networked part of this process shares: runners with remote
/// devices, nodes, cluster::connect. (CAF 0.17 gives every actor system of a process the same
/// node id, so two systems of one process on the network confuse their peers: when one closes
/// its connection, a node drops the other's actors too.) Created on first use with TLS settings
/// `t`; a later use with other TLS settings throws invalid_argument. It lives until the process
/// exits.
caf::actor_system& network_system(const tls& t);

/// Initializes OpenSSL (once) without its atexit() cleanup: the network system outlives exit().
void keep_openssl_until_exit();

/// Connects to the node at `address` and checks its protocol version; returns the node actor
/// and fills `devices`, `incarnation` and `leaving` (the node drains) when not null. Throws
/// node_error naming the node and the reason, at the latest after `deadline`, or within a
/// twentieth of a second once `cancelled` (when given) returns true: a cluster that closes does
/// not wait for its attempts under way (CAF's own attempt then ends in the background, at the
/// latest after limits::handshake_timeout).
caf::actor connect_node(caf::actor_system& sys, const std::string& address, const tls& t,
                        std::chrono::milliseconds deadline, std::vector<std::string>* devices,
                        std::uint64_t* incarnation = nullptr, bool* leaving = nullptr,
                        const std::function<bool()>& cancelled = {});

/// How long starting something on a node may take: connecting to it, and its answer to the
/// spawn (its constructor runs later, watched, in the caller's init).
struct node_deadlines {
  std::chrono::milliseconds connect{5000};
  std::chrono::milliseconds spawn{10000};
};

/// A random, non-zero 64-bit number: a node's incarnation.
std::uint64_t new_incarnation();

/// Remembers `t` as the TLS settings of the node at `address` (tls_for).
void remember_tls(const std::string& address, const tls& t);

/// The host that node::serve last served a node on without TLS in this process, or "" when it
/// served none (or only with TLS): where training replicas listen for their ring neighbours'
/// data (torch/src/ring_plane.hpp), which would otherwise bypass TLS.
std::string plain_serve_host();
/// node::serve: `host` serves a node without TLS (what plain_serve_host() returns).
void note_plain_serve_host(const std::string& host);

/// The TLS settings cluster::connect remembered for `address` (empty when none).
tls tls_for(const std::string& address);

}  // namespace troupe::detail
