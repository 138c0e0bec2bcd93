// The librsock.conf parser. Grammar (docs/config.md has the prose):
//
//   file    := { line '\n' }
//   line    := [ setting | rule | section ] [ '#' comment ]
//   setting := KEY '=' VALUE
//   rule    := ('rdma' | 'tcp') ('server' | 'client' | 'any') ADDRSPEC
//   section := '[' 'app' EXE_GLOB [ 'id=' ID_GLOB ] ']'
//   ADDRSPEC:= '*' [':' PORTS] | IPV4 ['/' N] [':' PORTS]
//            | '[' IPV6 ['/' N] ']' [':' PORTS] | IPV6 '/' N     (no port)
//   PORTS   := '*' | N | N '-' (N | '*')
//
// Every error names the exact line and column. The whole file is checked,
// including sections that do not match this process, so a typo is found on
// the machine where it was made rather than on the one program it affects.
#include <arpa/inet.h>

#include <cstring>
#include <optional>

#include "config/config.h"
#include "config/keys.h"

namespace rsock::config {

namespace {

using detail::KeySpec;

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Next whitespace-separated token of *rest (empty at end of line).
std::string_view next_token(std::string_view* rest) {
  std::string_view s = *rest;
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  size_t n = 0;
  while (n < s.size() && !is_space(s[n])) ++n;
  *rest = s.substr(n);
  return s.substr(0, n);
}

std::string quoted(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) out += '?';
    else out += c;
  }
  return out + "\"";
}

enum class Scope { kGlobal, kChosen, kOther };

class Parser {
 public:
  Parser(std::string_view file, const Identity& who, ParseError* err)
      : file_(file), who_(who), err_(err) {}

  Status<Config> run(std::string_view text);

 private:
  bool fail(std::string_view at, std::string what) {
    if (err_ != nullptr) {
      err_->file = std::string(file_);
      err_->line = line_no_;
      size_t col = 0;
      if (at.data() >= line_.data() && at.data() <= line_.data() + line_.size())
        col = static_cast<size_t>(at.data() - line_.data());
      err_->column = static_cast<uint32_t>(col + 1);
      err_->what = std::move(what);
    }
    return false;
  }

  bool parse_line(std::string_view content);
  bool parse_section(std::string_view content);
  bool parse_setting(std::string_view content, size_t eq);
  bool parse_rule(std::string_view content);
  bool parse_addr_spec(std::string_view tok, Rule* r);
  bool parse_prefix(std::string_view tok, bool v6_only, Rule* r);
  bool parse_ports(std::string_view tok, Rule* r);
  bool parse_port(std::string_view tok, uint16_t* out);

  Config& scope_config() { return scope_ == Scope::kOther ? scratch_ : cfg_; }

  std::string_view file_;
  const Identity& who_;
  ParseError* err_;
  uint32_t line_no_ = 0;
  std::string_view line_;

  Config cfg_;      // global settings, then the chosen section's on top
  Config scratch_;  // settings of sections that do not apply (checked, discarded)
  Scope scope_ = Scope::kGlobal;
  bool chosen_seen_ = false;
  uint64_t seen_mask_ = 0;        // keys set in the current scope
  uint32_t seen_line_[64] = {};
  std::vector<Rule> global_rules_;
  std::vector<Rule> section_rules_;
  std::optional<Action> global_default_;
  std::optional<Action> section_default_;
};

Status<Config> Parser::run(std::string_view text) {
  while (!text.empty() || line_no_ == 0) {
    size_t nl = text.find('\n');
    line_ = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no_;
    std::string_view content = line_.substr(0, line_.find('#'));
    if (!parse_line(content)) return Err(EINVAL);
    if (text.empty()) break;
  }
  Config out = std::move(cfg_);
  if (section_default_) {
    out.rules = std::move(section_rules_);
    out.default_action = *section_default_;
  } else {
    out.rules = std::move(section_rules_);
    out.rules.insert(out.rules.end(), global_rules_.begin(), global_rules_.end());
    out.default_action = global_default_.value_or(Action::kRdma);
  }
  out.source = std::string(file_);
  return out;
}

bool Parser::parse_line(std::string_view content) {
  std::string_view rest = content;
  std::string_view first = next_token(&rest);
  if (first.empty()) return true;
  if (first.front() == '[') return parse_section(trim(content));
  size_t eq = content.find('=');
  if (eq != std::string_view::npos) return parse_setting(content, eq);
  if (first == "rdma" || first == "tcp") return parse_rule(content);
  if (detail::find_key(first) != nullptr)
    return fail(rest.empty() ? first.substr(first.size()) : trim(rest),
                std::string("expected \"=\" after ") + std::string(first));
  return fail(first, "expected \"key = value\", a rule (rdma|tcp server|client|any ADDRESS[:PORTS])"
                     " or [app PATTERN], not " + quoted(first));
}

bool Parser::parse_section(std::string_view content) {
  if (content.back() != ']' || content.size() < 2)
    return fail(content.substr(content.size()), "missing \"]\" at the end of the section header");
  std::string_view rest = content.substr(1, content.size() - 2);
  std::string_view kind = next_token(&rest);
  if (kind != "app")
    return fail(kind.empty() ? content : kind,
                "unknown section " + quoted(content) + " (expected [app PATTERN] or [app PATTERN id=ID])");
  std::string_view pattern = next_token(&rest);
  if (pattern.empty() || pattern.substr(0, 3) == "id=")
    return fail(pattern.empty() ? rest : pattern,
                "[app] needs a program name pattern first, e.g. [app redis-server*] or [app * id=ID]");
  std::string_view id_pattern;
  std::string_view tok = next_token(&rest);
  if (!tok.empty()) {
    if (tok.substr(0, 3) != "id=" || tok.size() == 3)
      return fail(tok, "unexpected " + quoted(tok) + " in section header (expected id=PATTERN)");
    id_pattern = tok.substr(3);
    std::string_view extra = next_token(&rest);
    if (!extra.empty()) return fail(extra, "unexpected " + quoted(extra) + " after id=");
  }
  bool name_ok = glob_match(pattern, who_.exe) ||
                 (!who_.argv0.empty() && glob_match(pattern, who_.argv0));
  bool id_ok = id_pattern.empty() || (!who_.app_id.empty() && glob_match(id_pattern, who_.app_id));
  seen_mask_ = 0;
  if (!chosen_seen_ && name_ok && id_ok) {
    chosen_seen_ = true;
    scope_ = Scope::kChosen;
    cfg_.section = std::string(content);
    cfg_.section_line = line_no_;
  } else {
    scope_ = Scope::kOther;
  }
  return true;
}

bool Parser::parse_setting(std::string_view content, size_t eq) {
  std::string_view key_text = trim(content.substr(0, eq));
  std::string_view value = trim(content.substr(eq + 1));
  if (key_text.empty()) return fail(content.substr(eq), "missing key before \"=\"");
  std::string_view rest = key_text;
  std::string_view key_tok = next_token(&rest);
  if (!trim(rest).empty())
    return fail(trim(rest), "unexpected " + quoted(trim(rest)) + " before \"=\"");
  const KeySpec* key = detail::find_key(key_tok);
  if (key == nullptr) return fail(key_tok, "unknown key " + quoted(key_tok));
  size_t idx = static_cast<size_t>(key - detail::kKeys);
  if (seen_mask_ & (uint64_t{1} << idx))
    return fail(key_tok, std::string(key->name) + " is already set on line " +
                             std::to_string(seen_line_[idx]));
  seen_mask_ |= uint64_t{1} << idx;
  seen_line_[idx] = line_no_;
  if (value.empty()) return fail(content.substr(eq + 1), std::string("missing value for ") + key->name);
  // Numbers and words are single tokens; only log_file may contain spaces.
  if (key->kind != detail::KeyKind::kLogFile) {
    std::string_view vrest = value;
    next_token(&vrest);
    std::string_view extra = trim(vrest);
    if (!extra.empty()) return fail(extra, "unexpected " + quoted(extra) + " after the value");
  }
  std::string what;
  size_t off = 0;
  Config& target = scope_config();
  if (!detail::set_key(*key, value, &target, &what, &off)) return fail(value.substr(off), what);
  if (key->kind == detail::KeyKind::kDefault) {
    if (scope_ == Scope::kGlobal) global_default_ = target.default_action;
    if (scope_ == Scope::kChosen) section_default_ = target.default_action;
  }
  return true;
}

bool Parser::parse_rule(std::string_view content) {
  std::string_view rest = content;
  std::string_view action = next_token(&rest);
  Rule r;
  r.action = action == "rdma" ? Action::kRdma : Action::kTcp;
  r.line = line_no_;
  std::string_view dir = next_token(&rest);
  if (dir == "server") r.directions = 1;
  else if (dir == "client") r.directions = 2;
  else if (dir == "any") r.directions = 3;
  else if (dir.empty()) return fail(rest, "missing direction after " + std::string(action) + " (server, client or any)");
  else return fail(dir, "bad direction " + quoted(dir) + " (expected server, client or any)");
  std::string_view addr = next_token(&rest);
  if (addr.empty())
    return fail(rest, "missing address after " + std::string(dir) +
                          " (e.g. *, *:6379, 10.0.0.0/8:1000-2000, [fd00::/8]:*)");
  if (!parse_addr_spec(addr, &r)) return false;
  std::string_view extra = next_token(&rest);
  if (!extra.empty()) return fail(extra, "unexpected " + quoted(extra) + " after the address");
  if (scope_ == Scope::kGlobal) global_rules_.push_back(r);
  else if (scope_ == Scope::kChosen) section_rules_.push_back(r);
  return true;
}

bool Parser::parse_addr_spec(std::string_view tok, Rule* r) {
  if (tok == "*") return true;
  if (tok.substr(0, 2) == "*:") return parse_ports(tok.substr(2), r);
  if (tok.front() == '[') {
    size_t close = tok.find(']');
    if (close == std::string_view::npos) return fail(tok, "missing \"]\" after IPv6 address");
    if (!parse_prefix(tok.substr(1, close - 1), true, r)) return false;
    std::string_view after = tok.substr(close + 1);
    if (after.empty()) return true;
    if (after.front() != ':') return fail(after, "expected \":PORTS\" after \"]\"");
    return parse_ports(after.substr(1), r);
  }
  size_t colons = 0;
  for (char c : tok) colons += c == ':';
  if (colons >= 2) return parse_prefix(tok, true, r);  // bare IPv6: no port possible
  size_t colon = tok.find(':');
  if (!parse_prefix(tok.substr(0, colon), false, r)) return false;
  if (colon == std::string_view::npos) return true;
  return parse_ports(tok.substr(colon + 1), r);
}

bool Parser::parse_prefix(std::string_view tok, bool v6_only, Rule* r) {
  size_t slash = tok.find('/');
  std::string_view addr = tok.substr(0, slash);
  bool v6 = addr.find(':') != std::string_view::npos;
  if (addr.empty()) return fail(tok, "missing address");
  if (v6_only && !v6)
    return fail(addr, "bad IPv6 address " + quoted(addr) + " (IPv4 addresses are written without brackets)");
  char buf[INET6_ADDRSTRLEN + 1];
  if (addr.size() >= sizeof buf) return fail(addr, "bad address " + quoted(addr));
  memcpy(buf, addr.data(), addr.size());
  buf[addr.size()] = '\0';
  uint8_t bytes[16] = {};
  if (inet_pton(v6 ? AF_INET6 : AF_INET, buf, bytes) != 1) {
    bool hostname = false;
    for (char c : addr) hostname |= (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    return fail(addr, "bad " + std::string(v6 ? "IPv6" : "IPv4") + " address " + quoted(addr) +
                          (hostname && !v6 ? " (host names are not resolved; write an address)" : ""));
  }
  unsigned max_len = v6 ? 128 : 32;
  unsigned len = max_len;
  if (slash != std::string_view::npos) {
    std::string_view p = tok.substr(slash + 1);
    uint64_t v = 0;
    if (!detail::parse_unsigned(p, false, &v)) return fail(p, "bad prefix length " + quoted(p));
    if (v > max_len)
      return fail(p, "prefix length " + std::string(p) + " is too long for " + (v6 ? "IPv6" : "IPv4") +
                         " (at most " + std::to_string(max_len) + ")");
    len = static_cast<unsigned>(v);
  }
  r->family = v6 ? AF_INET6 : AF_INET;
  r->prefix_len = static_cast<uint8_t>(len);
  memcpy(r->addr, bytes, 16);
  return true;
}

bool Parser::parse_port(std::string_view tok, uint16_t* out) {
  uint64_t v = 0;
  if (!detail::parse_unsigned(tok, false, &v))
    return fail(tok, "bad port " + quoted(tok) + " (expected a number, N-M or *)");
  if (v > 65535) return fail(tok, "port " + std::string(tok) + " is out of range (0-65535)");
  *out = static_cast<uint16_t>(v);
  return true;
}

bool Parser::parse_ports(std::string_view tok, Rule* r) {
  if (tok.empty()) return fail(tok, "missing port after \":\" (use * for any port)");
  if (tok == "*") return true;
  size_t dash = tok.find('-');
  if (!parse_port(tok.substr(0, dash), &r->port_lo)) return false;
  if (dash == std::string_view::npos) {
    r->port_hi = r->port_lo;
    return true;
  }
  std::string_view hi = tok.substr(dash + 1);
  if (hi == "*") {
    r->port_hi = 65535;
    return true;
  }
  if (!parse_port(hi, &r->port_hi)) return false;
  if (r->port_hi < r->port_lo) return fail(tok, "port range " + std::string(tok) + " is reversed");
  return true;
}

}  // namespace

Status<Config> parse(std::string_view text, std::string_view file_name, const Identity& who,
                     ParseError* error) {
  Parser p(file_name, who, error);
  return p.run(text);
}

Status<void> apply_env(Config* cfg, GetEnv getenv_fn, ParseError* error) {
  for (size_t i = 0; i < detail::kNumKeys; ++i) {
    const KeySpec& key = detail::kKeys[i];
    char name[64] = "RSOCK_";
    size_t n = 6;
    for (const char* p = key.name; *p != '\0' && n + 1 < sizeof name; ++p)
      name[n++] = (*p >= 'a' && *p <= 'z') ? static_cast<char>(*p - 'a' + 'A') : *p;
    name[n] = '\0';
    const char* value = getenv_fn(name);
    if (value == nullptr) continue;
    std::string what;
    size_t off = 0;
    if (!detail::set_key(key, std::string_view(value), cfg, &what, &off)) {
      if (error != nullptr) {
        error->file = std::string("$") + name;
        error->line = 1;
        error->column = static_cast<uint32_t>(off + 1);
        error->what = std::move(what);
      }
      return Err(EINVAL);
    }
  }
  return Ok();
}

}  // namespace rsock::config
