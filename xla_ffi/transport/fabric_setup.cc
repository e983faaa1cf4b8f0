// The libfabric transport's set-up (fabric_transport.h): the provider
// (fi_getinfo with what herring_jax needs, EFA or tcp;ofi_rxm by default),
// its domain, completion queue, address vector and endpoint, the peers'
// addresses, and what the transport says of itself.
#include <arpa/inet.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/fabric_transport.h"

namespace herring::transport::fabric {

std::string FiError(const char* what, int ret) {
  return std::string(what) + " failed: " + fi_strerror(-ret) + " (" +
         std::to_string(ret) + ")";
}

namespace {

// The providers this machine offers with what herring_jax needs (an RDM
// endpoint with tagged messages), in libfabric's order of preference, for the
// error that says a requested one is missing: a misspelt name and a provider
// without its hardware (efa off AWS) look alike to fi_getinfo.
std::string AvailableProviders() {
  InfoPtr hints(fi_allocinfo());
  if (!hints) return "(fi_allocinfo failed)";
  hints->caps = FI_TAGGED;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  fi_info* raw = nullptr;
  const int ret = fi_getinfo(kFabricVersion, nullptr, nullptr, 0, hints.get(), &raw);
  InfoPtr list(raw);
  if (ret != 0 || raw == nullptr) return std::string("none (") + fi_strerror(-ret) + ")";
  std::vector<std::string> names;
  for (const fi_info* i = raw; i != nullptr; i = i->next) {
    const std::string name = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

std::string MissingProvider(const std::string& errors) {
  return errors + ". Providers available here: " + AvailableProviders() +
         ". Set HERRING_FI_PROVIDER to one of them, or leave it empty (efa where the machine "
         "has it, else tcp;ofi_rxm); `fi_info -l` lists them too.";
}

bool LooksLikeIpAddress(const std::string& s) {
  unsigned char buf[16];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

Status FabricTransport::Open(const TransportOptions& options) {
  force_mr_ = options.force_mr;
  max_posted_ = options.max_posted;
  progress_slice_us_ = options.progress_slice_us;
  post_timeout_s_ = options.post_timeout_s;
  InfoPtr hints(fi_allocinfo());
  if (!hints) return Status::Error("fi_allocinfo failed");
  hints->caps = FI_TAGGED;
  hints->ep_attr->type = FI_EP_RDM;
  // Only the mode bits this file honours (FI_CONTEXT/2 via Op::ctx).
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // Without FI_MR_LOCAL first: a provider that needs registered buffers
  // (EFA) then registers them itself, through its registration cache and
  // the memory monitor that invalidates it when XLA frees and reuses memory.
  // EFA opens that cache only when the application did not take FI_MR_LOCAL
  // (efa_domain.c, libfabric 1.17), so asking for it meant one fi_mr_reg and
  // one deregistration per message. Providers that cannot work that way are
  // asked again with FI_MR_LOCAL; HERRING_FI_FORCE_MR takes it always.
  const uint64_t mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->mr_mode = force_mr_ ? mr_mode | FI_MR_LOCAL : mr_mode;
  hints->domain_attr->threading = FI_THREAD_SAFE;
  hints->fabric_attr->prov_name = strdup(options.provider.c_str());

  const char* node = nullptr;
  uint64_t flags = 0;
  if (!options.interface.empty()) {
    if (LooksLikeIpAddress(options.interface)) {
      node = options.interface.c_str();
      flags = FI_SOURCE;
    } else if (std::getenv("FI_TCP_IFACE") == nullptr) {
      // Interface names reach the IP providers through FI_TCP_IFACE and
      // friends, which herring_jax sets at import (herring_jax/_src/
      // fabric_env.py): never setenv here, other threads may read the
      // environment.
      std::fprintf(stderr, "herring_jax: interface '%s' requested but FI_TCP_IFACE is "
                   "unset; set HERRING_FI_IFACE before importing herring_jax\n",
                   options.interface.c_str());
    }
  }
  if (options.eager_bytes > 0 && std::getenv("FI_OFI_RXM_EAGER_LIMIT") == nullptr) {
    // ofi_rxm sends messages above its eager limit (16 KiB by default) by
    // rendezvous: the receiver asks for the data with a read request. Over
    // tcp that request queues behind the receiver's own bulk sends on the
    // same connection, so when both directions are busy (every rank is
    // worker and server) each direction got half the link: measured on a
    // 250 Mbit/s flow, 127 Mbit/s each way with rendezvous, 238 eager.
    // herring_jax sets FI_OFI_RXM_EAGER_LIMIT at import (fabric_env.py).
    std::fprintf(stderr, "herring_jax: FI_OFI_RXM_EAGER_LIMIT is unset; ofi_rxm will send "
                 "chunks by rendezvous (half the rate on a link busy both ways)\n");
  }
  // Directed receives (a receive posted for one peer's address matches only
  // that peer's messages, whatever the tag's sender bits claim) and source
  // addresses in completions (who really sent a control message, whose
  // receive takes any sender): first with them, then, for a provider that
  // lacks them, without.
  fi_info* raw = nullptr;
  int ret = -FI_ENODATA;
  for (const uint64_t checks : {uint64_t{FI_DIRECTED_RECV | FI_SOURCE}, uint64_t{0}}) {
    hints->caps = FI_TAGGED | checks;
    hints->domain_attr->mr_mode = force_mr_ ? mr_mode | FI_MR_LOCAL : mr_mode;
    ret = fi_getinfo(kFabricVersion, node, nullptr, flags, hints.get(), &raw);
    if ((ret != 0 || raw == nullptr) && !force_mr_) {
      hints->domain_attr->mr_mode = mr_mode | FI_MR_LOCAL;
      ret = fi_getinfo(kFabricVersion, node, nullptr, flags, hints.get(), &raw);
    }
    if (ret == 0 && raw != nullptr) break;
  }
  if (ret != 0 || raw == nullptr) {
    no_provider_ = true;
    return Status::Error("no libfabric provider '" + options.provider +
                         "' with FI_EP_RDM and FI_TAGGED" +
                         (node ? std::string(" on ") + node : std::string()) + ": " +
                         fi_strerror(-ret));
  }
  info_.reset(raw);
  directed_ = (info_->caps & FI_DIRECTED_RECV) != 0;
  sources_ = (info_->caps & FI_SOURCE) != 0;
  // libfabric 1.17's ofi_rxd does not name a completion's sender by the
  // address its address vector gave out: over udp;ofi_rxd every control
  // message came "from rank 0's address" and was dropped (heartbeats, so
  // that live ranks were declared dead after HERRING_PEER_TIMEOUT_S;
  // aborts; the leave protocol's notices, so that every exit waited as
  // long). Its sources go unchecked, as a provider's that names none.
  if (std::strstr(info_->fabric_attr->prov_name, "ofi_rxd") != nullptr) sources_ = false;
  need_mr_ = force_mr_ || (info_->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
  prov_key_ = (info_->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
  if (info_->tx_attr->iov_limit < 2 || info_->rx_attr->iov_limit < 2) {
    return Status::Error("provider " + std::string(info_->fabric_attr->prov_name) +
                         " supports fewer than 2 iov entries per message");
  }

  fid_fabric* fabric = nullptr;
  if ((ret = fi_fabric(info_->fabric_attr, &fabric, nullptr)) != 0)
    return Status::Error(FiError("fi_fabric", ret));
  fabric_.reset(fabric);
  fid_domain* domain = nullptr;
  if ((ret = fi_domain(fabric_.get(), info_.get(), &domain, nullptr)) != 0)
    return Status::Error(FiError("fi_domain", ret));
  domain_.reset(domain);

  // Each direction may hand the provider as many operations as its queue
  // holds, and both together never more than the completion queue holds,
  // so that no completion can find the queue full. More wait in pending_.
  const size_t tx_size = info_->tx_attr->size > 0 ? info_->tx_attr->size : kCqSize / 2;
  const size_t rx_size = info_->rx_attr->size > 0 ? info_->rx_attr->size : kCqSize / 2;
  send_budget_ = std::min(tx_size, kCqSize / 2);
  recv_budget_ = std::min(rx_size, kCqSize / 2);
  if (max_posted_ > 0) {
    send_budget_ = std::min(send_budget_, max_posted_);
    recv_budget_ = std::min(recv_budget_, max_posted_);
  }
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_TAGGED;
  cq_attr.size = kCqSize;
  // A wait object lets the progress thread sleep in the kernel until data
  // arrives instead of spinning; providers without one (EFA) are polled,
  // and so is shm: its fi_cq_sread (libfabric 1.17) did not return within
  // its timeout while nothing completed, so the progress thread never came
  // back to post a send that waited in the queue (its first send to a peer
  // returns -FI_EAGAIN until the peer has mapped its region); 1 reduction
  // in 3 hung at its first message.
  const bool shm = std::string(info_->fabric_attr->prov_name).rfind("shm", 0) == 0;
  cq_attr.wait_obj = FI_WAIT_UNSPEC;
  fid_cq* cq = nullptr;
  ret = shm ? -FI_ENOSYS : fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr);
  if (ret != 0) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    if ((ret = fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr)) != 0)
      return Status::Error(FiError("fi_cq_open", ret));
  } else {
    can_wait_ = true;
    // tcp's progress is driven by its sockets, which the wait object
    // watches: nothing is due until one becomes ready or Wake signals the
    // queue. Other providers may keep timers (ofi_rxd retransmits) and
    // are read at least every millisecond.
    block_ms_ = std::string(info_->fabric_attr->prov_name).rfind("tcp", 0) == 0 ? 100 : 1;
  }
  cq_.reset(cq);

  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  fid_av* av = nullptr;
  if ((ret = fi_av_open(domain_.get(), &av_attr, &av, nullptr)) != 0)
    return Status::Error(FiError("fi_av_open", ret));
  av_.reset(av);

  fid_ep* ep = nullptr;
  if ((ret = fi_endpoint(domain_.get(), info_.get(), &ep, nullptr)) != 0)
    return Status::Error(FiError("fi_endpoint", ret));
  ep_.reset(ep);
  if ((ret = fi_ep_bind(ep_.get(), &av_->fid, 0)) != 0)
    return Status::Error(FiError("fi_ep_bind(av)", ret));
  if ((ret = fi_ep_bind(ep_.get(), &cq_->fid, FI_TRANSMIT | FI_RECV)) != 0)
    return Status::Error(FiError("fi_ep_bind(cq)", ret));
  if ((ret = fi_enable(ep_.get())) != 0) return Status::Error(FiError("fi_enable", ret));

  size_t len = 0;
  fi_getname(&ep_->fid, nullptr, &len);
  address_.resize(len);
  if ((ret = fi_getname(&ep_->fid, address_.data(), &len)) != 0)
    return Status::Error(FiError("fi_getname", ret));
  address_.resize(len);

  running_ = true;
  progress_ = std::thread([this] { ProgressLoop(); });
  return Status::Ok();
}

Status FabricTransport::SetPeers(const std::vector<std::vector<uint8_t>>& addrs) {
  peers_.assign(addrs.size(), FI_ADDR_NOTAVAIL);
  unreachable_.reset(new std::atomic<bool>[addrs.size()]());
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    lane_pending_.assign(addrs.size() + 1, 0);
  }
  for (size_t i = 0; i < addrs.size(); ++i) {
    int ret = fi_av_insert(av_.get(), addrs[i].data(), 1, &peers_[i], 0, nullptr);
    if (ret != 1) {
      return Status::Error("fi_av_insert of rank " + std::to_string(i) +
                           "'s address failed: " + fi_strerror(ret < 0 ? -ret : FI_EINVAL));
    }
  }
  return Status::Ok();
}

std::string FabricTransport::Describe() const {
  return std::string(info_->fabric_attr->prov_name) + " (fabric " +
         info_->fabric_attr->name + ", domain " + info_->domain_attr->name +
         (need_mr_ ? ", registered buffers" : "") +
         (directed_ ? ", directed receives" : "") + (sources_ ? ", sources checked" : "") +
         (can_wait_ ? ", blocking progress" : ", polled progress") + ")";
}

}  // namespace herring::transport::fabric

namespace herring::transport {

using fabric::FabricTransport;
using fabric::MissingProvider;

std::unique_ptr<Transport> CreateFabricTransport(const TransportOptions& options,
                                                 Status* status) {
  if (!options.provider.empty()) {
    auto transport = std::make_unique<FabricTransport>();
    *status = transport->Open(options);
    if (!status->ok()) {
      if (transport->no_provider()) *status = Status::Error(MissingProvider(status->message()));
      return nullptr;
    }
    return transport;
  }
  // Default: EFA where the machine has it, else TCP with the RDM utility layer.
  std::string errors;
  bool missing = true;
  for (const char* provider : {"efa", "tcp;ofi_rxm"}) {
    TransportOptions attempt = options;
    attempt.provider = provider;
    auto transport = std::make_unique<FabricTransport>();
    *status = transport->Open(attempt);
    if (status->ok()) return transport;
    missing = missing && transport->no_provider();
    errors += std::string(errors.empty() ? "" : "; ") + status->message();
  }
  *status = Status::Error(missing ? MissingProvider(errors) : errors);
  return nullptr;
}

}  // namespace herring::transport
