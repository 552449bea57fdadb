// The protocol's old path, kept so that code including it still compiles: the messages are in
// namespace troupe (probes send them), so their header is <troupe/protocol.hpp>.
#pragma once

#include "troupe/protocol.hpp"
