// The per-job code of a runner, behind two small interfaces: a producer's work loop over a
// chunk and a consumer's loop over outputs. Only this part is a template instantiated in the
// user's translation unit; the actors that drive it, the scheduler and the network code are
// compiled once, in the library.
#pragma once

#include "troupe/detail/typed_producer.hpp"

namespace troupe::detail {

/// Registers the job's input and output types for the wire format (options::serialize, probes
/// that serialize). Throws invalid_argument when one of them has no inspect() overload.
template <class Job>
void register_wire_types() {
  using in = typename job_traits<Job>::input_type;
  using out = typename job_traits<Job>::output_type;
  if constexpr (wire_serializable<in> && wire_serializable<out>) {
    ensure_batch_type<in>();
    ensure_batch_type<out>();
  } else {
    throw invalid_argument(
        "options::serialize: the job's input or output type cannot be serialized (give it an "
        "inspect() overload); it could not cross a network either");
  }
}

/// Where a job's consumer leaves consumer::end()'s value for job_handle::get().
template <class R>
using result_slot = std::shared_ptr<std::optional<R>>;

template <class Job>
class typed_consumer final : public consumer_ops {
 public:
  using traits = job_traits<Job>;
  using out = typename traits::output_type;

  typed_consumer(const config& cfg, result_slot<typename traits::result_type> slot)
      : c_(make_with<typename traits::consumer_type>(cfg)), slot_(std::move(slot)) {}

  bool work(batch& outputs, job_gate& gate) override {
    auto& c = *c_;
    if constexpr (traits::folds) {
      if (outputs.get() != nullptr &&
          outputs.get()->item_type() == typeid(folded_chunk<consumer_type>)) {
        // A chunk folded on its producer: its consumer merged in, as one step.
        auto& folded = *static_cast<const folded_chunk<consumer_type>*>(outputs.get());
        if (gate.stopped()) return true;
        member_ = "merge";
        c.merge(std::move(folded.part()));
        member_ = "work";
        gate.add_delivered(folded.size());
        folded.dispose();  // here, before the job can end: not wherever the message goes
        return true;
      }
    }
    auto* items = outputs.as<out>();
    if (items == nullptr) return false;
    std::uint64_t n = 0;
    struct count {  // also when work() throws: what it took before counts as delivered
      job_gate& g;
      std::uint64_t& n;
      ~count() { g.add_delivered(n); }
    } counted{gate, n};
    auto& xs = items->items;
    if constexpr (std::is_same<out, bool>::value) {  // std::vector<bool>: no data()
      for (; n < xs.size() && !gate.stopped(); ++n) c.work(bool(xs[n]));
    } else {
      consume_checked(c, xs.data(), xs.size(), gate, fast_, n);
    }
    return true;
  }
  void end() override { slot_->emplace(c_->end()); }
  void destroy() override { c_.reset(); }
  [[nodiscard]] const char* member() const noexcept override { return member_; }

 private:
  using consumer_type = typename traits::consumer_type;

  throwing_owner<typename traits::consumer_type> c_;
  result_slot<typename traits::result_type> slot_;
  bool fast_ = false;            ///< the last chunk of 64 items or more took under 100 ns per item
  const char* member_ = "work";  ///< the member work() calls: "merge" for a folded chunk
};

template <class Job>
consumer_maker make_consumer_maker(result_slot<typename job_traits<Job>::result_type> slot) {
  return [slot = std::move(slot)](const config& cfg) -> std::unique_ptr<consumer_ops> {
    return std::make_unique<typed_consumer<Job>>(cfg, slot);
  };
}

}  // namespace troupe::detail
