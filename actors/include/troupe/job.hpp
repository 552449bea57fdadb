// What troupe needs to know about a job type, checked with static_asserts that name the
// missing or malformed member.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/device.hpp"
#include "troupe/span.hpp"

namespace troupe::detail {

/// The producer's index as a constructor argument: converts to std::size_t and to nothing else,
/// so that a constructor (device, config, bool verbose = false) is not handed the index.
struct producer_index_arg {
  std::size_t value;
  template <class T, std::enable_if_t<std::is_same<T, std::size_t>::value, int> = 0>
  operator T() const noexcept {  // NOLINT: implicit on purpose
    return value;
  }
};

template <class F>
struct member_fn {
  static constexpr std::size_t arity = static_cast<std::size_t>(-1);
  using result = void;
  using arg = void;
};

template <class... A>
struct first_arg {
  using type = void;
};
template <class A, class... As>
struct first_arg<A, As...> {
  using type = A;
};

#define TROUPE_MEMBER_FN(qualifiers)                   \
  template <class C, class R, class... A>              \
  struct member_fn<R (C::*)(A...) qualifiers> {        \
    static constexpr std::size_t arity = sizeof...(A); \
    using result = R;                                  \
    using arg = typename first_arg<A...>::type;        \
  };
TROUPE_MEMBER_FN()
TROUPE_MEMBER_FN(const)
TROUPE_MEMBER_FN(noexcept)
TROUPE_MEMBER_FN(const noexcept)
#undef TROUPE_MEMBER_FN

template <class T, class = void>
struct has_producer : std::false_type {};
template <class T>
struct has_producer<T, std::void_t<typename T::producer>> : std::true_type {};

template <class T, class = void>
struct has_consumer : std::false_type {};
template <class T>
struct has_consumer<T, std::void_t<typename T::consumer>> : std::true_type {};

template <class T, class = void>
struct has_work : std::false_type {};
template <class T>
struct has_work<T, std::void_t<decltype(&T::work)>> : std::true_type {};

template <class T, class = void>
struct has_end : std::false_type {};
template <class T>
struct has_end<T, std::void_t<decltype(std::declval<T&>().end())>> : std::true_type {};

/// A consumer that can take in another consumer's results: `void merge(consumer&& other)`.
template <class T, class = void>
struct has_merge : std::false_type {};
template <class T>
struct has_merge<T, std::void_t<decltype(std::declval<T&>().merge(std::declval<T&&>()))>>
    : std::true_type {};

/// A producer with `void warmup()`: called once after its construction, before its first chunk.
template <class T, class = void>
struct has_warmup : std::false_type {};
template <class T>
struct has_warmup<T, std::void_t<decltype(std::declval<T&>().warmup())>> : std::true_type {};

/// A job with `struct device_state`: one per device and process, shared by that device's
/// producers (docs/api.md, "Real models on producers").
template <class T, class = void>
struct has_device_state : std::false_type {};
template <class T>
struct has_device_state<T, std::void_t<typename T::device_state>> : std::true_type {};

template <class Job, bool = has_device_state<Job>::value>
struct device_state_of {
  using type = void;
};
template <class Job>
struct device_state_of<Job, true> {
  using type = typename Job::device_state;
};

/// The consumer of a job that has none: collects outputs into a vector.
template <class Out>
struct collecting_consumer {
  std::vector<Out> items;
  void work(Out x) { items.push_back(std::move(x)); }
  std::vector<Out> end() { return std::move(items); }
};

template <class Job, class Out, bool = has_consumer<Job>::value>
struct consumer_of {
  using type = collecting_consumer<Out>;
};
template <class Job, class Out>
struct consumer_of<Job, Out, true> {
  using type = typename Job::consumer;
};

template <class P, bool = has_work<P>::value>
struct work_signature {
  using type = member_fn<void>;
};
template <class P>
struct work_signature<P, true> {
  using type = member_fn<decltype(&P::work)>;
};

/// What producer::work takes and gives: one item, or (a batch producer) a span of items and a
/// vector of outputs, one per item, in order.
template <class Arg, class Result, bool = is_span<std::decay_t<Arg>>::value>
struct work_items {
  static constexpr bool batched = false;
  using input_type = std::decay_t<Arg>;
  using output_type = std::decay_t<Result>;
};
template <class Arg, class Result>
struct work_items<Arg, Result, true> {
  static constexpr bool batched = true;
  using span_type = std::decay_t<Arg>;
  static_assert(std::is_const<typename span_type::element_type>::value,
                "troupe: a batch producer's work takes troupe::span<const Input>");
  using input_type = typename span_type::value_type;
  using result = std::decay_t<Result>;
  static_assert(std::is_same<result, std::vector<typename result::value_type>>::value,
                "troupe: a batch producer's work(troupe::span<const Input>) must return "
                "std::vector<Output>, one output per item, in order");
  using output_type = typename result::value_type;
};

template <class Job>
struct job_traits {
  static_assert(
      has_producer<Job>::value,
      "troupe: a job needs a nested `struct producer` with a member `Output work(Input)`");
  using producer_type = typename Job::producer;
  static_assert(has_work<producer_type>::value,
                "troupe: Job::producer needs one member function `Output work(Input)` "
                "(not overloaded, not a template)");
  using work_sig = typename work_signature<producer_type>::type;
  static_assert(work_sig::arity == 1,
                "troupe: Job::producer::work must take exactly one argument (the input item)");
  using work_arg = typename work_sig::arg;
  static_assert(!std::is_lvalue_reference<work_arg>::value ||
                    std::is_const<std::remove_reference_t<work_arg>>::value,
                "troupe: Job::producer::work must take its input by value, const& or &&");
  using items = work_items<work_arg, typename work_sig::result>;
  /// producer::work(troupe::span<const In>) -> std::vector<Out>: called once per batch of items
  /// (docs/api.md, "Batch producers").
  static constexpr bool batched = items::batched;
  using input_type = typename items::input_type;
  using output_type = typename items::output_type;
  static_assert(!std::is_void<output_type>::value,
                "troupe: Job::producer::work must return the output item (it returns void)");
  static_assert(std::is_copy_constructible<input_type>::value &&
                    std::is_copy_constructible<output_type>::value,
                "troupe: the input and output types of Job::producer::work must be copyable");
  /// Job::device_state, or void.
  using device_state_type = typename device_state_of<Job>::type;
  static constexpr bool shares_state = has_device_state<Job>::value;
  static_assert(!shares_state ||
                    std::is_constructible<device_state_type, const device&, const config&>::value,
                "troupe: Job::device_state needs a constructor taking (const troupe::device&, "
                "const troupe::config&)");
  static_assert(shares_state ||
                    std::is_constructible<producer_type, const device&, const config&,
                                          producer_index_arg>::value ||
                    std::is_constructible<producer_type, const device&, const config&>::value ||
                    std::is_constructible<producer_type, const device&>::value ||
                    std::is_default_constructible<producer_type>::value,
                "troupe: Job::producer needs a constructor taking (const troupe::device&, const "
                "troupe::config&, std::size_t index), (const troupe::device&, const "
                "troupe::config&), (const troupe::device&) or nothing");
  static_assert(!shares_state ||
                    std::is_constructible<producer_type, const device&, const config&,
                                          std::add_lvalue_reference_t<device_state_type>>::value,
                "troupe: a job with a device_state needs Job::producer(const troupe::device&, "
                "const troupe::config&, device_state&)");

  static constexpr bool has_job_consumer = has_consumer<Job>::value;
  using consumer_type = typename consumer_of<Job, output_type>::type;
  static_assert(has_work<consumer_type>::value,
                "troupe: Job::consumer needs one member function `void work(Output)` "
                "(not overloaded, not a template)");
  using consume_sig = typename work_signature<consumer_type>::type;
  static_assert(consume_sig::arity == 1,
                "troupe: Job::consumer::work must take exactly one argument (an output item)");
  static_assert(!std::is_lvalue_reference<typename consume_sig::arg>::value ||
                    std::is_const<std::remove_reference_t<typename consume_sig::arg>>::value,
                "troupe: Job::consumer::work must take its output by value, const& or &&");
  static_assert(has_end<consumer_type>::value,
                "troupe: Job::consumer needs a member `Result end()`: run() returns its value");
  using result_type = std::decay_t<decltype(std::declval<consumer_type&>().end())>;
  static_assert(!std::is_void<result_type>::value,
                "troupe: Job::consumer::end() must return the run's result (it returns void)");
  static_assert(
      std::is_constructible<consumer_type, const config&>::value ||
          std::is_default_constructible<consumer_type>::value,
      "troupe: Job::consumer needs a constructor taking (const troupe::config&) or nothing");
  /// The job's consumer has merge(): local producers fold their chunks' outputs into consumers
  /// of their own, which the job's consumer merges (docs/api.md, "Folding on the producers").
  static constexpr bool folds = has_job_consumer && has_merge<consumer_type>::value &&
                                !std::is_same<output_type, bool>::value && !batched;
};

/// Constructs a producer from what it accepts of (device, config, index in the runner).
template <class T>
std::unique_ptr<T> make_producer(const device& d, const config& cfg, std::size_t index) {
  if constexpr (std::is_constructible<T, const device&, const config&, producer_index_arg>::value)
    return std::make_unique<T>(d, cfg, producer_index_arg{index});
  else if constexpr (std::is_constructible<T, const device&, const config&>::value)
    return std::make_unique<T>(d, cfg);
  else if constexpr (std::is_constructible<T, const device&>::value)
    return std::make_unique<T>(d);
  else
    return std::make_unique<T>();
}

/// Constructs T from what it accepts of (device, config).
template <class T>
std::unique_ptr<T> make_with(const device& d, const config& cfg) {
  if constexpr (std::is_constructible<T, const device&, const config&>::value)
    return std::make_unique<T>(d, cfg);
  else if constexpr (std::is_constructible<T, const device&>::value)
    return std::make_unique<T>(d);
  else
    return std::make_unique<T>();
}

template <class T>
std::unique_ptr<T> make_with(const config& cfg) {
  if constexpr (std::is_constructible<T, const config&>::value)
    return std::make_unique<T>(cfg);
  else
    return std::make_unique<T>();
}

}  // namespace troupe::detail
