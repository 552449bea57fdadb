// The metrics library's private parts (metrics/src): what its files share.
#pragma once

namespace troupe::detail {

/// The live page's HTML (status_page.cpp).
const char* status_page() noexcept;

}  // namespace troupe::detail
