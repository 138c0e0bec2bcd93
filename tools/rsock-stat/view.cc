#include "tools/rsock-stat/view.h"

#include <pwd.h>
#include <time.h>

#include <cstdarg>
#include <cstdio>

namespace rsock_stat {

namespace {

using rsock::stats::ConnState;
using rsock::stats::Direction;
using rsock::stats::FallbackReason;
using rsock::stats::kFallbackReasons;
using rsock::stats::Transport;
using rsock::stats::TrafficTotals;

constexpr int kTcp = static_cast<int>(Transport::kTcp);
constexpr int kRdma = static_cast<int>(Transport::kRdma);

uint64_t tx(const TrafficTotals& t) { return t.tx_bytes[0] + t.tx_bytes[1]; }
uint64_t rx(const TrafficTotals& t) { return t.rx_bytes[0] + t.rx_bytes[1]; }

std::string user_name(uint32_t uid) {
  passwd* pw = getpwuid(uid);
  return pw != nullptr ? pw->pw_name : std::to_string(uid);
}

std::string uptime(uint64_t start_unix_ms, uint64_t now_ms) {
  uint64_t s = now_ms > start_unix_ms ? (now_ms - start_unix_ms) / 1000 : 0;
  char buf[32];
  if (s >= 86400) snprintf(buf, sizeof buf, "%llud%02lluh", (unsigned long long)(s / 86400), (unsigned long long)(s % 86400 / 3600));
  else if (s >= 3600) snprintf(buf, sizeof buf, "%lluh%02llum", (unsigned long long)(s / 3600), (unsigned long long)(s % 3600 / 60));
  else snprintf(buf, sizeof buf, "%llum%02llus", (unsigned long long)(s / 60), (unsigned long long)(s % 60));
  return buf;
}

const char* transport_of(const ConnSnapshot& c) {
  return rsock::stats::transport_name(static_cast<Transport>(c.info.transport));
}
const char* state_of(const ConnSnapshot& c) {
  return rsock::stats::state_name(static_cast<ConnState>(c.info.state));
}
// "rejected:no_resources" when the peer said why.
const char* reason_of(const ConnSnapshot& c) {
  auto r = static_cast<FallbackReason>(c.info.fallback_reason);
  const char* name = rsock::stats::fallback_reason_name(r);
  if (r != FallbackReason::kRejected || c.info.peer_reason == 0) return name;
  static thread_local char buf[64];
  snprintf(buf, sizeof buf, "%s:%s", name, rsock::stats::peer_reason_name(c.info.peer_reason));
  return buf;
}
const char* dir_of(const ConnSnapshot& c) {
  return rsock::stats::direction_name(static_cast<Direction>(c.info.direction));
}
std::string local_of(const ConnSnapshot& c) {
  return rsock::stats::format_endpoint(c.info.family, c.info.local_addr, c.info.local_port);
}
std::string peer_of(const ConnSnapshot& c) {
  return rsock::stats::format_endpoint(c.info.family, c.info.peer_addr, c.info.peer_port);
}

std::tuple<int, uint32_t, uint32_t, uint32_t> conn_key(int pid, const ConnSnapshot& c) {
  return {pid, c.file_index, c.slot_index, c.info.generation};
}

// --- tiny JSON writer ---------------------------------------------------------

std::string jstr(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20 || ch >= 0x7f) {
      char buf[8];
      snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

std::string jnum(uint64_t v) { return std::to_string(v); }
std::string jdbl(double v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// Microseconds as milliseconds for the connection table; "-" while unknown.
std::string ms_cell(uint32_t us) {
  if (us == 0) return "-";
  char b[32];
  snprintf(b, sizeof b, "%.1f", double(us) / 1000);
  return b;
}

std::string json_traffic(const TrafficTotals& t, int i) {
  return "{\"tx_bytes\":" + jnum(t.tx_bytes[i]) + ",\"rx_bytes\":" + jnum(t.rx_bytes[i]) +
         ",\"tx_ops\":" + jnum(t.tx_ops[i]) + ",\"rx_ops\":" + jnum(t.rx_ops[i]) + "}";
}

std::string json_conn(const ProcessSnapshot& p, const ConnSnapshot& c, const Rates& rates, bool with_pid) {
  std::string o = "{";
  if (with_pid) o += "\"pid\":" + std::to_string(p.pid) + ",\"exe\":" + jstr(p.exe) + ",";
  o += "\"fd\":" + std::to_string(c.info.fd) + ",\"direction\":" + jstr(dir_of(c)) +
       ",\"local\":" + jstr(local_of(c)) + ",\"peer\":" + jstr(peer_of(c)) +
       ",\"state\":" + jstr(state_of(c)) + ",\"transport\":" + jstr(transport_of(c)) +
       ",\"fallback_reason\":" + jstr(reason_of(c)) + ",\"qp_num\":" + jnum(c.info.qp_num) +
       ",\"tx_bytes\":" + jnum(tx(c.traffic)) + ",\"rx_bytes\":" + jnum(rx(c.traffic)) +
       ",\"rdma\":" + json_traffic(c.traffic, kRdma) + ",\"tcp\":" + json_traffic(c.traffic, kTcp) +
       ",\"credit_stalls\":" + jnum(c.traffic.credit_stalls) +
       ",\"send_ring_fill\":" + jnum(c.send_ring_fill) + ",\"recv_ring_fill\":" + jnum(c.recv_ring_fill) +
       ",\"ring_bytes\":" + jnum(c.ring_bytes) + ",\"send_credits\":" + jnum(c.send_credits) +
       ",\"upgrade_us\":" + jnum(c.upgrade_us) + ",\"switch_us\":" + jnum(c.switch_us) +
       ",\"opened_unix_ms\":" + jnum(c.info.opened_unix_ms) + ",\"torn\":" + (c.torn ? "true" : "false");
  if (rates.seconds > 0) {
    auto it = rates.conn.find(conn_key(p.pid, c));
    if (it != rates.conn.end())
      o += ",\"tx_bytes_per_s\":" + jdbl(it->second.first) + ",\"rx_bytes_per_s\":" + jdbl(it->second.second);
  }
  return o + "}";
}

std::string json_process(const ProcessSnapshot& p, const Rates& rates, bool with_conns) {
  ProcessSummary sum = summarize(p);
  std::string o = "{\"pid\":" + std::to_string(p.pid) + ",\"uid\":" + std::to_string(p.uid) +
                  ",\"exe\":" + jstr(p.exe) + ",\"librsock\":" + jstr(p.release) +
                  ",\"start_unix_ms\":" + jnum(p.start_unix_ms) +
                  ",\"conns_open\":" + jnum(sum.conns_open) + ",\"conns_rdma\":" + jnum(sum.conns_rdma) +
                  ",\"conns_tcp\":" + jnum(sum.conns_tcp) + ",\"conns_seen\":" + jnum(p.conns_seen) +
                  ",\"conns_upgraded\":" + jnum(p.conns_upgraded) +
                  ",\"conns_untracked\":" + jnum(p.conns_untracked) +
                  ",\"handshake_errors\":" + jnum(p.handshake_errors) +
                  ",\"pinned_bytes\":" + jnum(p.pinned_bytes) + ",\"pinned_budget\":" +
                  (p.pinned_budget == UINT64_MAX ? std::string("null") : jnum(p.pinned_budget)) +
                  ",\"kits_idle\":" + jnum(p.kits_idle) + ",\"kits_reused\":" + jnum(p.kits_reused) +
                  ",\"switches\":{\"count\":" + jnum(p.switches) + ",\"switch_us_sum\":" + jnum(p.switch_us_sum) +
                  ",\"switch_us_max\":" + jnum(p.switch_us_max) + ",\"upgrade_us_sum\":" + jnum(p.upgrade_us_sum) +
                  "},\"fallbacks\":{";
  for (int i = 1; i < kFallbackReasons; ++i) {
    if (i > 1) o += ",";
    o += jstr(rsock::stats::fallback_reason_name(static_cast<FallbackReason>(i))) + ":" + jnum(p.fallbacks[i]);
  }
  o += "},\"rdma\":" + json_traffic(p.total, kRdma) + ",\"tcp\":" + json_traffic(p.total, kTcp) +
       ",\"tx_bytes\":" + jnum(tx(p.total)) + ",\"rx_bytes\":" + jnum(rx(p.total)) +
       ",\"credit_stalls\":" + jnum(p.total.credit_stalls) + ",\"segment_files\":" + jnum(p.files) +
       ",\"segment_slots\":" + jnum(p.slots);
  if (rates.seconds > 0) {
    auto it = rates.proc.find({p.pid, p.start_time});
    if (it != rates.proc.end())
      o += ",\"tx_bytes_per_s\":" + jdbl(it->second.first) + ",\"rx_bytes_per_s\":" + jdbl(it->second.second);
  }
  if (with_conns) {
    o += ",\"connections\":[";
    for (size_t i = 0; i < p.conns.size(); ++i) o += (i ? "," : "") + json_conn(p, p.conns[i], rates, false);
    o += "]";
  }
  return o + "}";
}

std::string json_errors(const Round& r) {
  std::string o = "[";
  for (size_t i = 0; i < r.errors.size(); ++i)
    o += std::string(i ? "," : "") + "{\"pid\":" + std::to_string(r.errors[i].pid) +
         ",\"error\":" + jstr(r.errors[i].message) + "}";
  return o + "]";
}

// --- text ---------------------------------------------------------------------

std::string rate_cell(const Rates& rates, const std::pair<double, double>* v, bool tx_side) {
  if (rates.seconds <= 0 || v == nullptr) return "-";
  return human_bytes(tx_side ? v->first : v->second) + "/s";
}

void append(std::string* out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void append(std::string* out, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  *out += buf;
}

std::string text_list(const Round& r, const Rates& rates) {
  std::string o;
  append(&o, "%-8s %-10s %-18s %9s %6s %5s %5s %8s %9s %9s %9s %9s %9s", "PID", "USER", "EXE", "UPTIME",
         "CONNS", "RDMA", "TCP", "FALLBACK", "RDMA_TX", "RDMA_RX", "TCP_TX", "TCP_RX", "UNTRACKED");
  if (rates.seconds > 0) append(&o, " %10s %10s", "TX/s", "RX/s");
  o += "\n";
  for (const auto& p : r.procs) {
    ProcessSummary sum = summarize(p);
    append(&o, "%-8d %-10.10s %-18.18s %9s %6llu %5llu %5llu %8llu %9s %9s %9s %9s %9llu", p.pid,
           user_name(p.uid).c_str(), p.exe.c_str(), uptime(p.start_unix_ms, r.unix_ms).c_str(),
           (unsigned long long)sum.conns_open, (unsigned long long)sum.conns_rdma,
           (unsigned long long)sum.conns_tcp, (unsigned long long)sum.fallbacks,
           human_bytes(double(p.total.tx_bytes[kRdma])).c_str(),
           human_bytes(double(p.total.rx_bytes[kRdma])).c_str(), human_bytes(double(p.total.tx_bytes[kTcp])).c_str(),
           human_bytes(double(p.total.rx_bytes[kTcp])).c_str(), (unsigned long long)p.conns_untracked);
    if (rates.seconds > 0) {
      auto it = rates.proc.find({p.pid, p.start_time});
      const std::pair<double, double>* v = it == rates.proc.end() ? nullptr : &it->second;
      append(&o, " %10s %10s", rate_cell(rates, v, true).c_str(), rate_cell(rates, v, false).c_str());
    }
    o += "\n";
  }
  for (const auto& e : r.errors) append(&o, "%-8d unreadable: %s\n", e.pid, e.message.c_str());
  if (r.procs.empty() && r.errors.empty()) o += "(no process is using librsock)\n";
  return o;
}

std::string text_process(const Round& r, const Rates& rates) {
  std::string o;
  for (const auto& e : r.errors) append(&o, "rsock-stat: %s\n", e.message.c_str());
  for (const auto& p : r.procs) {
    append(&o, "pid %d (%s), user %s, up %s, librsock %s\n", p.pid, p.exe.c_str(),
           user_name(p.uid).c_str(), uptime(p.start_unix_ms, r.unix_ms).c_str(),
           p.release.empty() ? "?" : p.release.c_str());
    append(&o, "connections: %llu seen, %zu open, %llu upgraded to rdma, %llu untracked, %llu handshake errors\n",
           (unsigned long long)p.conns_seen, p.conns.size(), (unsigned long long)p.conns_upgraded,
           (unsigned long long)p.conns_untracked, (unsigned long long)p.handshake_errors);
    append(&o, "rdma resources: %s pinned of %s, %llu kits kept for new connections, %llu reused\n",
           human_bytes(double(p.pinned_bytes)).c_str(),
           p.pinned_budget == UINT64_MAX ? "no limit" : human_bytes(double(p.pinned_budget)).c_str(),
           (unsigned long long)p.kits_idle, (unsigned long long)p.kits_reused);
    if (p.switches == 0) {
      o += "switches onto rdma: none\n";
    } else {
      append(&o, "switches onto rdma: %llu, %.1f ms on average, %.1f ms the longest", (unsigned long long)p.switches,
             double(p.switch_us_sum) / double(p.switches) / 1000, double(p.switch_us_max) / 1000);
      if (p.conns_upgraded != 0)
        append(&o, "; on rdma %.1f ms after the socket's start on average",
               double(p.upgrade_us_sum) / double(p.conns_upgraded) / 1000);
      o += "\n";
    }
    std::string fb;
    for (int i = 1; i < kFallbackReasons; ++i)
      if (p.fallbacks[i] != 0)
        append(&fb, " %s=%llu", rsock::stats::fallback_reason_name(static_cast<FallbackReason>(i)),
               (unsigned long long)p.fallbacks[i]);
    append(&o, "fallbacks:%s\n", fb.empty() ? " none" : fb.c_str());
    for (int t : {kRdma, kTcp})
      append(&o, "%-4s tx %s in %llu ops, rx %s in %llu ops\n", t == kRdma ? "rdma" : "tcp",
             human_bytes(double(p.total.tx_bytes[t])).c_str(), (unsigned long long)p.total.tx_ops[t],
             human_bytes(double(p.total.rx_bytes[t])).c_str(), (unsigned long long)p.total.rx_ops[t]);
    append(&o, "credit stalls %llu; segment: %u file(s), %u slots\n\n", (unsigned long long)p.total.credit_stalls,
           p.files, p.slots);
    append(&o, "%-5s %-6s %-24s %-24s %-11s %-5s %-14s %9s %9s %8s %8s %11s %5s %6s %8s %8s %9s", "FD", "DIR",
           "LOCAL", "PEER", "STATE", "VIA", "FALLBACK", "TX", "RX", "TX_OPS", "RX_OPS", "RING_S/R", "CRED", "STALLS",
           "QPN", "UP_MS", "SWITCH_MS");
    if (rates.seconds > 0) append(&o, " %10s %10s", "TX/s", "RX/s");
    o += "\n";
    for (const auto& c : p.conns) {
      std::string ring = human_bytes(c.send_ring_fill) + "/" + human_bytes(c.recv_ring_fill);
      append(&o, "%-5d %-6s %-24s %-24s %-11s %-5s %-14s %9s %9s %8llu %8llu %11s %5u %6llu %8u", c.info.fd,
             dir_of(c), local_of(c).c_str(), peer_of(c).c_str(), state_of(c), transport_of(c), reason_of(c),
             human_bytes(double(tx(c.traffic))).c_str(), human_bytes(double(rx(c.traffic))).c_str(),
             (unsigned long long)(c.traffic.tx_ops[0] + c.traffic.tx_ops[1]),
             (unsigned long long)(c.traffic.rx_ops[0] + c.traffic.rx_ops[1]), ring.c_str(), c.send_credits,
             (unsigned long long)c.traffic.credit_stalls, c.info.qp_num);
      append(&o, " %8s %9s", ms_cell(c.upgrade_us).c_str(), ms_cell(c.switch_us).c_str());
      if (rates.seconds > 0) {
        auto it = rates.conn.find(conn_key(p.pid, c));
        const std::pair<double, double>* v = it == rates.conn.end() ? nullptr : &it->second;
        append(&o, " %10s %10s", rate_cell(rates, v, true).c_str(), rate_cell(rates, v, false).c_str());
      }
      o += "\n";
    }
    if (p.conns.empty()) o += "(no open connections)\n";
  }
  return o;
}

std::string text_netstat(const Round& r, const Rates& rates) {
  std::string o;
  append(&o, "%-5s %-24s %-24s %-11s %-6s %-14s %9s %9s %-20s", "VIA", "LOCAL", "PEER", "STATE", "DIR",
         "FALLBACK", "TX", "RX", "PID/PROGRAM:FD");
  if (rates.seconds > 0) append(&o, " %10s %10s", "TX/s", "RX/s");
  o += "\n";
  for (const auto& p : r.procs) {
    for (const auto& c : p.conns) {
      std::string who = std::to_string(p.pid) + "/" + p.exe + ":" + std::to_string(c.info.fd);
      append(&o, "%-5s %-24s %-24s %-11s %-6s %-14s %9s %9s %-20s", transport_of(c), local_of(c).c_str(),
             peer_of(c).c_str(), state_of(c), dir_of(c), reason_of(c), human_bytes(double(tx(c.traffic))).c_str(),
             human_bytes(double(rx(c.traffic))).c_str(), who.c_str());
      if (rates.seconds > 0) {
        auto it = rates.conn.find(conn_key(p.pid, c));
        const std::pair<double, double>* v = it == rates.conn.end() ? nullptr : &it->second;
        append(&o, " %10s %10s", rate_cell(rates, v, true).c_str(), rate_cell(rates, v, false).c_str());
      }
      o += "\n";
    }
  }
  for (const auto& e : r.errors) append(&o, "(pid %d unreadable: %s)\n", e.pid, e.message.c_str());
  return o;
}

// --- Prometheus text format --------------------------------------------------
// https://prometheus.io/docs/instrumenting/exposition_formats/ : per metric
// family one # HELP and one # TYPE line, then all its samples together.

// Length of the valid UTF-8 sequence at s[0..n), 0 if it is not one.
size_t utf8_sequence(const unsigned char* s, size_t n) {
  unsigned char c = s[0];
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xbf;  // allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // > U+10FFFF
  } else {
    return 0;
  }
  if (n < len || s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < len; ++i)
    if (s[i] < 0x80 || s[i] > 0xbf) return 0;
  return len;
}

void prom_family(std::string* o, const char* name, const char* type, const char* help) {
  append(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void prom_sample(std::string* o, const char* name, const std::string& labels, uint64_t v) {
  append(o, "%s{%s} %llu\n", name, labels.c_str(), (unsigned long long)v);
}

double rate(uint64_t now, uint64_t before, double secs) {
  return now >= before ? double(now - before) / secs : 0.0;  // a closing conn may dip
}

}  // namespace

ProcessSummary summarize(const ProcessSnapshot& p) {
  ProcessSummary s;
  s.conns_open = p.conns.size();
  for (const auto& c : p.conns) s.conns_rdma += c.info.transport == kRdma;
  s.conns_tcp = s.conns_open - s.conns_rdma;
  for (int i = 1; i < kFallbackReasons; ++i) s.fallbacks += p.fallbacks[i];
  return s;
}

std::string prometheus_label_value(const std::string& s) {
  std::string out;
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    size_t len = utf8_sequence(b + i, s.size() - i);
    if (len == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD: the format is UTF-8
      ++i;
      continue;
    }
    if (b[i] == '\\') out += "\\\\";
    else if (b[i] == '"') out += "\\\"";
    else if (b[i] == '\n') out += "\\n";
    else out.append(s, i, len);
    i += len;
  }
  return out;
}

std::string render_prometheus(const Round& r) {
  std::string o;
  std::vector<std::string> labels;  // pid="..",exe="..", per process
  std::vector<ProcessSummary> sums;
  for (const auto& p : r.procs) {
    labels.push_back("pid=\"" + std::to_string(p.pid) + "\",exe=\"" + prometheus_label_value(p.exe) + "\"");
    sums.push_back(summarize(p));
  }
  const int transports[] = {kRdma, kTcp};
  auto tname = [](int t) { return rsock::stats::transport_name(static_cast<Transport>(t)); };
  // One family whose value per process is f(process, summary).
  auto per_process = [&](const char* name, const char* type, const char* help, auto f) {
    prom_family(&o, name, type, help);
    for (size_t i = 0; i < r.procs.size(); ++i) prom_sample(&o, name, labels[i], f(r.procs[i], sums[i]));
  };
  // One family with a transport label; f(process, summary, transport index).
  auto per_transport = [&](const char* name, const char* type, const char* help, auto f) {
    prom_family(&o, name, type, help);
    for (size_t i = 0; i < r.procs.size(); ++i)
      for (int t : transports)
        prom_sample(&o, name, labels[i] + ",transport=\"" + tname(t) + "\"", f(r.procs[i], sums[i], t));
  };
  using P = const ProcessSnapshot&;
  using S = const ProcessSummary&;
  per_process("rsock_connections_seen_total", "counter",
              "TCP connections librsock has seen (connected or accepted) since the process started.",
              [](P p, S) { return p.conns_seen; });
  per_process("rsock_connections_upgraded_total", "counter", "Connections that were moved onto RDMA.",
              [](P p, S) { return p.conns_upgraded; });
  per_process("rsock_connections_untracked_total", "counter",
              "Connections without a stats slot (the stats segment could not grow).",
              [](P p, S) { return p.conns_untracked; });
  per_process("rsock_connections_open", "gauge", "Open connections.", [](P, S s) { return s.conns_open; });
  per_transport("rsock_transport_connections_open", "gauge",
                "Open connections by the transport carrying them (tcp also while connecting or upgrading).",
                [](P, S s, int t) { return t == kRdma ? s.conns_rdma : s.conns_tcp; });
  prom_family(&o, "rsock_fallbacks_total", "counter",
              "Connections that stayed on (or went back to) TCP, by reason.");
  for (size_t i = 0; i < r.procs.size(); ++i)
    for (int k = 1; k < kFallbackReasons; ++k)
      prom_sample(&o, "rsock_fallbacks_total",
                  labels[i] + ",reason=\"" +
                      rsock::stats::fallback_reason_name(static_cast<FallbackReason>(k)) + "\"",
                  r.procs[i].fallbacks[k]);
  per_process("rsock_handshake_errors_total", "counter", "Upgrades that failed once both ends had met over RDMA.",
              [](P p, S) { return p.handshake_errors; });
  per_process("rsock_credit_stalls_total", "counter", "RDMA sends that waited for credits from the peer.",
              [](P p, S) { return p.total.credit_stalls; });
  per_process("rsock_pinned_bytes", "gauge",
              "Registered (pinned) memory librsock holds: live connections' rings and kept kits.",
              [](P p, S) { return p.pinned_bytes; });
  per_process("rsock_kits_idle", "gauge",
              "Closed connections' verbs resources kept for the next connections.",
              [](P p, S) { return p.kits_idle; });
  per_process("rsock_kits_reused_total", "counter",
              "Connections that took a closed connection's verbs resources.",
              [](P p, S) { return p.kits_reused; });
  per_process("rsock_switches_total", "counter",
              "Switches onto RDMA (first upgrades and upgrades again after a switch back).",
              [](P p, S) { return p.switches; });
  per_process("rsock_switch_microseconds_total", "counter",
              "Time the switches onto RDMA took in all (RDMA connection up to on RDMA; new writes wait meanwhile).",
              [](P p, S) { return p.switch_us_sum; });
  per_process("rsock_switch_microseconds_max", "gauge", "The longest switch onto RDMA.",
              [](P p, S) { return p.switch_us_max; });
  per_process("rsock_upgrade_microseconds_total", "counter",
              "Time from the socket's start to its first time on RDMA, summed over the upgraded connections.",
              [](P p, S) { return p.upgrade_us_sum; });
  per_transport("rsock_tx_bytes_total", "counter", "Bytes sent, by transport (closed connections included).",
                [](P p, S, int t) { return p.total.tx_bytes[t]; });
  per_transport("rsock_rx_bytes_total", "counter", "Bytes received, by transport (closed connections included).",
                [](P p, S, int t) { return p.total.rx_bytes[t]; });
  per_transport("rsock_tx_ops_total", "counter", "Send operations, by transport (closed connections included).",
                [](P p, S, int t) { return p.total.tx_ops[t]; });
  per_transport("rsock_rx_ops_total", "counter", "Receive operations, by transport (closed connections included).",
                [](P p, S, int t) { return p.total.rx_ops[t]; });
  prom_family(&o, "rsock_stat_unreadable_segments", "gauge",
              "Stats segments rsock-stat found but could not read (corrupt, or another layout version).");
  append(&o, "rsock_stat_unreadable_segments %zu\n", r.errors.size());
  // A comment line each (ignored by parsers; escaped so it stays one line).
  for (const auto& e : r.errors)
    o += "# rsock-stat: pid " + std::to_string(e.pid) + " unreadable: " + prometheus_label_value(e.message) + "\n";
  return o;
}

std::string human_bytes(double v) {
  const char* units[] = {"", "K", "M", "G", "T", "P"};
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) snprintf(buf, sizeof buf, "%.0f", v);
  else snprintf(buf, sizeof buf, "%.1f%s", v, units[u]);
  return buf;
}

Rates compute_rates(const Round& prev, const Round& cur) {
  Rates r;
  if (prev.unix_ms == 0 || cur.unix_ms <= prev.unix_ms) return r;
  r.seconds = double(cur.unix_ms - prev.unix_ms) / 1000.0;
  std::map<std::pair<int, uint64_t>, const ProcessSnapshot*> before;
  std::map<std::tuple<int, uint32_t, uint32_t, uint32_t>, const ConnSnapshot*> before_conn;
  for (const auto& p : prev.procs) {
    before[{p.pid, p.start_time}] = &p;
    for (const auto& c : p.conns) before_conn[conn_key(p.pid, c)] = &c;
  }
  for (const auto& p : cur.procs) {
    auto it = before.find({p.pid, p.start_time});
    if (it != before.end())
      r.proc[{p.pid, p.start_time}] = {rate(tx(p.total), tx(it->second->total), r.seconds),
                                       rate(rx(p.total), rx(it->second->total), r.seconds)};
    for (const auto& c : p.conns) {
      auto ci = before_conn.find(conn_key(p.pid, c));
      if (ci != before_conn.end())
        r.conn[conn_key(p.pid, c)] = {rate(tx(c.traffic), tx(ci->second->traffic), r.seconds),
                                      rate(rx(c.traffic), rx(ci->second->traffic), r.seconds)};
    }
  }
  return r;
}

std::string render_text(View v, const Round& r, const Rates& rates) {
  switch (v) {
    case View::kList: return text_list(r, rates);
    case View::kProcess: return text_process(r, rates);
    case View::kNetstat: return text_netstat(r, rates);
  }
  return "";
}

std::string render_json(View v, const Round& r, const Rates& rates) {
  std::string o = "{\"version\":1,\"unix_ms\":" + jnum(r.unix_ms);
  if (rates.seconds > 0) o += ",\"interval_s\":" + jdbl(rates.seconds);
  switch (v) {
    case View::kList:
      o += ",\"processes\":[";
      for (size_t i = 0; i < r.procs.size(); ++i) o += (i ? "," : "") + json_process(r.procs[i], rates, false);
      o += "]";
      break;
    case View::kProcess:
      o += ",\"process\":" + (r.procs.empty() ? std::string("null") : json_process(r.procs[0], rates, true));
      break;
    case View::kNetstat: {
      o += ",\"connections\":[";
      bool first = true;
      for (const auto& p : r.procs)
        for (const auto& c : p.conns) {
          o += (first ? "" : ",") + json_conn(p, c, rates, true);
          first = false;
        }
      o += "]";
      break;
    }
  }
  return o + ",\"errors\":" + json_errors(r) + "}\n";
}

}  // namespace rsock_stat
