// Finding nodes (cluster_options::discover): troupe::dns_discovery, and the cluster's discovery
// thread (cluster_core.hpp), which joins the addresses that appear and drains those that vanish.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

#include "cluster_core.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"

namespace troupe {

std::function<std::vector<std::string>()> dns_discovery(const std::string& name_port) {
  auto hp = detail::parse_host_port(name_port);
  if (hp.port == 0)
    throw invalid_argument("dns_discovery('" + name_port +
                           "'): port 0 is no node's port (the port the nodes serve on)");
  return [host = hp.host, port = std::to_string(hp.port)] {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0)
      throw node_error("dns_discovery: " + host + " does not resolve (" + gai_strerror(rc) + ")");
    std::set<std::string> out;
    for (auto* p = res; p != nullptr; p = p->ai_next) {
      char text[INET_ADDRSTRLEN] = {0};
      auto* in = reinterpret_cast<sockaddr_in*>(p->ai_addr);
      if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr)
        out.insert(std::string{text} + ":" + port);
    }
    ::freeaddrinfo(res);
    if (out.empty()) throw node_error("dns_discovery: " + host + " has no IPv4 address");
    return std::vector<std::string>(out.begin(), out.end());
  };
}

namespace detail {

void cluster_core::discover_loop() {
  bool failing = false;
  while (pause(o_.discover_every)) {
    std::vector<std::string> found;
    try {
      found = o_.discover();
    } catch (const std::exception& e) {
      if (!failing)
        log(log_level::warn, std::string{"cluster discovery failed (nothing changes until it "
                                         "succeeds again): "} +
                                 e.what());
      failing = true;
      continue;
    } catch (...) {
      if (!failing) log(log_level::warn, "cluster discovery failed (nothing changes)");
      failing = true;
      continue;
    }
    if (failing) log(log_level::info, "cluster discovery succeeds again");
    failing = false;
    std::set<std::string> now(found.begin(), found.end());
    std::set<std::string> before, given;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      before = discovered_;
      discovered_ = now;
      given = given_;
    }
    for (auto& a : now)
      if (!before.count(a) && !stopping()) appear(a);
    for (auto& a : before)  // connect()'s own addresses stay, whatever discovery says
      if (!now.count(a) && !given.count(a) && !stopping()) vanish(a);
  }
}

void cluster_core::appear(const std::string& address) {
  try {
    parse_host_port(address);
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto st = core_.state_of(address);
      if (st && (*st == member::state::up || *st == member::state::draining)) return;
    }
    auto r = reach(address);
    if (r.error || r.leaving) {
      std::lock_guard<std::mutex> guard{mtx_};
      core_.expect(address, clock::now());  // the reconnector tries it until it answers
      log(log_level::info, "cluster: discovered " + address + ", not up yet: retried");
      return;
    }
    admit(r, false);
  } catch (const std::exception& e) {
    log(log_level::warn, "cluster: discovered " + address + ", not joined: " + e.what());
  }
}

void cluster_core::vanish(const std::string& address) {
  std::optional<member::state> st;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    st = core_.state_of(address);
    if (!st) return;
    if (*st != member::state::up) {
      core_.retire(address);  // not retried any more
      return;
    }
  }
  try {
    remove(address);
  } catch (const std::exception& e) {
    log(log_level::warn,
        "cluster: " + address + " is no longer discovered, but stays: " + e.what());
  }
}

}  // namespace detail
}  // namespace troupe
