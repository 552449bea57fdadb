// troupe: device-bound producer actors, a consumer and a scheduler, behind two runners.
// The umbrella header. Tensor support: <troupe/torch.hpp>. Testing: <troupe/testing.hpp>.
#pragma once

#include "troupe/config.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/generate.hpp"
#include "troupe/log.hpp"
#include "troupe/node.hpp"
#include "troupe/options.hpp"
#include "troupe/register.hpp"
#include "troupe/runner.hpp"
