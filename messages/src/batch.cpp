#include "troupe/batch.hpp"

#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/sec.hpp>
#include <mutex>
#include <typeindex>
#include <unordered_map>

#include "troupe/error.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/internal/named_registry.hpp"

namespace troupe {
namespace {

detail::named_registry<batch_factory>& batch_registry() {
  // Never destroyed: actor and network threads may still look types up while exit() runs.
  static auto& instance = *new detail::named_registry<batch_factory>;
  return instance;
}

}  // namespace

void register_batch_type(const std::string& name, const std::type_info& type,
                         batch_factory factory) {
  batch_registry().add(name, type, std::move(factory));
}

std::string batch_type_name(const std::type_info& type) {
  return batch_registry().name_of(type);
}

std::unique_ptr<batch_base> make_batch(const std::string& name) {
  auto factory = batch_registry().find(name);
  return factory ? factory() : nullptr;
}

std::size_t detail::bytes_left(caf::deserializer& source) noexcept {
  if (auto binary = dynamic_cast<caf::binary_deserializer*>(&source)) return binary->remaining();
  if (auto joined = dynamic_cast<bulk::reader*>(&source)) return joined->remaining();
  return static_cast<std::size_t>(-1);
}

caf::error batch::save_to(caf::serializer& sink) const {
  std::string name = !ptr_                            ? std::string{"-"}
                     : bulk::is_reference(ptr_.get()) ? std::string{"@bulk"}
                                                      : batch_type_name(ptr_->item_type());
  if (name.empty()) return caf::make_error(caf::sec::state_not_serializable);
  if (auto err = sink(name)) return err;
  return ptr_ ? ptr_->save(sink) : caf::error{};
}

caf::error batch::load_from(caf::deserializer& source) {
  std::string name;
  if (auto err = source(name)) return err;
  if (name == "-") {
    ptr_.reset();
    return {};
  }
  auto fresh = name == "@bulk" ? bulk::make_reference_batch() : make_batch(name);
  if (!fresh) return caf::make_error(caf::sec::unknown_type);
  if (auto err = fresh->load(source)) return err;
  ptr_ = std::move(fresh);
  return {};
}

batch round_trip_batch(const batch& b, const std::string& what) {
  if (!b) return b;
  auto type = b.get()->item_type().name();
  if (!bulk::is_reference(b.get()) && batch_type_name(b.get()->item_type()).empty())
    throw protocol_error(what + " (item type " + std::string{type} +
                         ") cannot be serialized: the type is not registered "
                         "(TROUPE_REGISTER_JOB(job) or troupe::register_batch_type<T>())");
  std::vector<char> bytes;
  caf::binary_serializer sink{nullptr, bytes};
  if (auto err = b.save_to(sink))
    throw protocol_error(what + " (item type " + type +
                         ") failed to serialize: " + caf::to_string(err));
  caf::binary_deserializer source{nullptr, bytes};
  batch copy;
  if (auto err = copy.load_from(source))
    throw protocol_error(what + " (item type " + type + ") failed to deserialize: " +
                         caf::to_string(err) + ": its inspect() reads what it did not write");
  if (source.remaining() != 0)
    throw protocol_error(what + " (item type " + type + "): " + std::to_string(source.remaining()) +
                         " serialized bytes were left unread: its inspect() writes more than "
                         "it reads");
  return copy;
}

}  // namespace troupe
