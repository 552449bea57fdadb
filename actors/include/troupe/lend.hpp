// troupe::lend(xs): hand a job the caller's range to read in place, instead of a copy.
#pragma once

#include <type_traits>

namespace troupe {

/// A range lent to one job (troupe::lend). It must outlive the job's get() (or the handle).
template <class Range>
class lent {
 public:
  explicit lent(Range& r) noexcept : r_(&r) {}
  [[nodiscard]] Range& range() const noexcept { return *r_; }

 private:
  Range* r_;
};

/// submit(troupe::lend(xs)): the job reads `xs` in place (a contiguous range of numbers is lent
/// to the producers, the zero-copy path) instead of copying it; `xs` must outlive the job's
/// get() or handle. run(xs) always lends: it returns after the job.
template <class Range>
lent<Range> lend(Range& r) noexcept {
  return lent<Range>{r};
}
template <class Range>
void lend(const Range&& r) = delete;  // a temporary dies at the end of the statement

}  // namespace troupe
