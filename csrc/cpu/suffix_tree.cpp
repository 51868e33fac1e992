// A path-compressed suffix tree for Suffix Decoding (vllm/v1/spec_decode/suffix_tree.py
// states the semantics; PySuffixTree there is the plain trie these equal, draft for draft).
//
// Every suffix of every sequence, cut at max_depth tokens, is a path from the root. A node
// is an edge of `length` tokens, read from a sequence's own tokens (ref_seq, ref_idx), and
// `count` is how many suffixes pass through it. Invariant: every suffix ends at the end of
// a node's edge (or at the root), so a count holds along a whole edge. Appending a token
// to a sequence extends each of its live suffixes (the last max_depth) by one token:
//   - into a child of one token: that child's count + 1;
//   - into a longer child: the child splits after its first token;
//   - when the suffix is the only one ending at its node and all the node's others go on
//     into one child: the node's edge grows by one token instead (no split), and a child
//     left empty is fused into it; this keeps repeated text from splitting node by node;
//   - with no child: a leaf that is this suffix's alone grows; otherwise a new leaf.
// A sequence's tokens are kept while a node still reads its edge from them, after the
// sequence is removed too (refs counts those nodes).
//
// A node's children are a list ranked by count, the first the one a draft follows. Ties
// keep Arctic Inference's order (the implementation vLLM calls), so drafts are the same:
// a new child goes last; a child whose count grows moves before the first sibling of its
// previous sibling's count when that count is its own or one more; a child whose count
// shrinks moves after the last sibling of its old count. Siblings of one count form a
// group that knows its first member, so each move is O(1).

#include <torch/custom_class.h>
#include <torch/script.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

constexpr int32_t kNone = -1;

struct Node {
  int32_t parent = kNone;
  int32_t token = 0;      // the edge's first token
  int32_t length = 0;     // tokens on the edge
  int32_t ref_seq = kNone;
  int32_t ref_idx = 0;    // the edge is seqs[ref_seq].tokens[ref_idx : ref_idx + length]
  int32_t count = 0;
  int32_t head = kNone, tail = kNone;  // the first and last child by rank
  int32_t prev_sib = kNone, next_sib = kNone;
  int32_t group = kNone;               // the siblings of this count
  int32_t num_children = 0;
};

struct Group {
  int32_t first = kNone;               // its first member
  int32_t prev = kNone, next = kNone;  // the groups of the next higher and lower counts
};

struct Seq {
  std::vector<int32_t> tokens;
  std::deque<int32_t> active;  // nodes where its live suffixes end
  int64_t refs = 0;            // nodes whose edge reads from these tokens
  bool removed = false;
};

class SuffixTree : public torch::CustomClassHolder {
 public:
  explicit SuffixTree(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 1) throw std::invalid_argument("max_depth must be >= 1");
    nodes_.emplace_back();  // the root
  }

  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_.size()); }

  void extend(int64_t seq_id, const at::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kInt && tokens.is_contiguous(),
                "tokens must be a contiguous 1-D int32 tensor");
    auto it = ids_.find(seq_id);
    int32_t s;
    if (it == ids_.end()) {
      s = next_seq_++;
      ids_.emplace(seq_id, s);
      seqs_.emplace(s, Seq{});
    } else {
      s = it->second;
    }
    const int32_t* data = tokens.data_ptr<int32_t>();
    for (int64_t i = 0; i < tokens.numel(); ++i) append(s, data[i]);
  }

  void remove(int64_t seq_id) {
    auto it = ids_.find(seq_id);
    if (it == ids_.end()) return;  // a sequence never given a token
    int32_t s = it->second;
    ids_.erase(it);
    Seq& seq = seqs_.at(s);
    seq.active.clear();
    const int32_t n = static_cast<int32_t>(seq.tokens.size());
    for (int32_t start = 0; start < n; ++start) {
      nodes_[0].count -= 1;
      int32_t node = 0, idx = start, left = std::min<int32_t>(max_depth_, n - start);
      while (left > 0) {
        int32_t child = find_child(node, seq.tokens[idx]);
        TORCH_CHECK(child != kNone, "suffix tree: a removed suffix is missing");
        if (nodes_[child].count == 1) {  // only this suffix: the child's subtree goes
          drop_subtree(child);
          break;
        }
        decrement(child);
        idx += nodes_[child].length;
        left -= nodes_[child].length;
        node = child;
      }
    }
    seq.removed = true;  // not before: the walk above reads its tokens
    release_seq(s);      // frees them unless a node still reads them
  }

  std::tuple<std::vector<int64_t>, std::vector<double>, double, int64_t> speculate(
      const at::Tensor& context, int64_t max_spec_tokens, double max_spec_factor,
      double max_spec_offset, double min_token_prob) {
    TORCH_CHECK(context.dim() == 1 && context.scalar_type() == at::kInt && context.is_contiguous(),
                "context must be a contiguous 1-D int32 tensor");
    const int32_t* ctx = context.data_ptr<int32_t>();
    const int64_t len = context.numel();
    const float min_prob = static_cast<float>(min_token_prob);
    std::vector<int64_t> best_tokens;
    std::vector<double> best_probs;
    float best_score = 0.0f;
    int64_t best_match = 0;
    for (int64_t match_len = 1; match_len < len; ++match_len) {
      int32_t node, idx;
      if (!match(ctx + len - match_len, match_len, &node, &idx)) break;
      float scaled = static_cast<float>(match_len) * static_cast<float>(max_spec_factor) +
                     static_cast<float>(max_spec_offset);
      int64_t limit = std::max<int64_t>(
          std::min<int64_t>(max_spec_tokens, static_cast<int64_t>(scaled + 1e-6)), 0);
      std::vector<int64_t> tokens;
      std::vector<double> probs;
      float prob = 1.0f, score = 0.0f;
      while (static_cast<int64_t>(tokens.size()) < limit && prob >= min_prob) {
        if (idx == nodes_[node].length) {  // the edge's end: on to the best child
          int32_t child = nodes_[node].head;
          if (child == kNone) break;
          prob *= static_cast<float>(nodes_[child].count) / static_cast<float>(nodes_[node].count);
          node = child;
          idx = 0;
          continue;
        }
        const Node& n = nodes_[node];
        tokens.push_back(seqs_.at(n.ref_seq).tokens[n.ref_idx + idx]);
        probs.push_back(prob);
        score += prob;
        ++idx;
      }
      if (score >= best_score) {
        best_tokens = std::move(tokens);
        best_probs = std::move(probs);
        best_score = score;
        best_match = match_len;
      }
    }
    return {best_tokens, best_probs, static_cast<double>(best_score), best_match};
  }

  // Every invariant, for tests: "" when they hold, else what does not.
  std::string check_invariants() const {
    for (size_t i = 1; i < nodes_.size(); ++i) {
      const Node& n = nodes_[i];
      if (n.count == 0) continue;  // free
      const std::string at = " at node " + std::to_string(i);
      int64_t below = 0, num = 0;
      int32_t prev = kNone, prev_group = kNone;
      for (int32_t c = n.head; c != kNone; prev = c, c = nodes_[c].next_sib) {
        const Node& k = nodes_[c];
        below += k.count;
        ++num;
        if (k.parent != static_cast<int32_t>(i)) return "child's parent" + at;
        if (k.prev_sib != prev) return "sibling links" + at;
        bool leads = prev == kNone || nodes_[prev].count != k.count;
        if (prev != kNone && nodes_[prev].count < k.count) return "rank by count" + at;
        if (leads != (groups_[k.group].first == c)) return "group's first" + at;
        if (!leads && k.group != nodes_[prev].group) return "group of a tie" + at;
        if (leads) {
          if (groups_[k.group].prev != prev_group) return "group links" + at;
          if (prev_group != kNone && groups_[prev_group].next != k.group) return "group links" + at;
          prev_group = k.group;
        }
      }
      if (prev != n.tail) return "tail" + at;
      if (prev_group != kNone && groups_[prev_group].next != kNone) return "last group" + at;
      if (below > n.count) return "children count more than the node" + at;
      if (num != n.num_children) return "num_children" + at;
      if (n.length < 1) return "empty edge" + at;
      const Seq& seq = seqs_.at(n.ref_seq);
      if (n.ref_idx < 0 || n.ref_idx + n.length > static_cast<int32_t>(seq.tokens.size()))
        return "edge out of its sequence" + at;
      if (seq.tokens[n.ref_idx] != n.token) return "edge token" + at;
      if (find_child(n.parent, n.token) != static_cast<int32_t>(i)) return "lookup" + at;
    }
    std::unordered_map<int32_t, int64_t> refs;
    for (size_t i = 1; i < nodes_.size(); ++i)
      if (nodes_[i].count > 0) refs[nodes_[i].ref_seq] += 1;
    for (const auto& [s, seq] : seqs_) {
      if (refs[s] != seq.refs) return "refs of sequence " + std::to_string(s);
      if (seq.removed && seq.refs == 0) return "removed sequence kept " + std::to_string(s);
    }
    return "";
  }

 private:
  int64_t max_depth_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  std::vector<Group> groups_;
  std::vector<int32_t> free_groups_;
  std::unordered_map<uint64_t, int32_t> lookup_;  // (parent, token) -> child
  std::unordered_map<int64_t, int32_t> ids_;      // the caller's sequence id -> ours
  std::unordered_map<int32_t, Seq> seqs_;
  int32_t next_seq_ = 0;

  static uint64_t key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  }

  int32_t find_child(int32_t parent, int32_t token) const {
    auto it = lookup_.find(key(parent, token));
    return it == lookup_.end() ? kNone : it->second;
  }

  void set_ref(int32_t node, int32_t seq, int32_t idx) {
    Node& n = nodes_[node];
    if (n.ref_seq != seq) {
      if (n.ref_seq != kNone) unref(n.ref_seq);
      seqs_.at(seq).refs += 1;
      n.ref_seq = seq;
    }
    n.ref_idx = idx;
  }

  void unref(int32_t seq) {
    Seq& s = seqs_.at(seq);
    s.refs -= 1;
    release_seq(seq);
  }

  void release_seq(int32_t seq) {
    auto it = seqs_.find(seq);
    if (it->second.removed && it->second.refs == 0) seqs_.erase(it);
  }

  int32_t alloc() {
    if (!free_.empty()) {
      int32_t n = free_.back();
      free_.pop_back();
      nodes_[n] = Node{};
      return n;
    }
    nodes_.emplace_back();
    return static_cast<int32_t>(nodes_.size() - 1);
  }

  int32_t new_group(int32_t first) {
    int32_t g;
    if (!free_groups_.empty()) {
      g = free_groups_.back();
      free_groups_.pop_back();
    } else {
      g = static_cast<int32_t>(groups_.size());
      groups_.emplace_back();
    }
    groups_[g] = Group{first, kNone, kNone};
    return g;
  }

  // Links group g into the group list between a and b (either kNone).
  void link_group(int32_t g, int32_t a, int32_t b) {
    groups_[g].prev = a;
    groups_[g].next = b;
    if (a != kNone) groups_[a].next = g;
    if (b != kNone) groups_[b].prev = g;
  }

  void unlink_group(int32_t g) {
    Group& x = groups_[g];
    if (x.prev != kNone) groups_[x.prev].next = x.next;
    if (x.next != kNone) groups_[x.next].prev = x.prev;
    free_groups_.push_back(g);
  }

  // Takes node n out of its parent's list and its group.
  void detach(int32_t n) {
    Node& x = nodes_[n];
    Node& p = nodes_[x.parent];
    Group& g = groups_[x.group];
    if (g.first == n) {
      if (x.next_sib != kNone && nodes_[x.next_sib].count == x.count) g.first = x.next_sib;
      else unlink_group(x.group);
    }
    x.group = kNone;
    if (x.prev_sib != kNone) nodes_[x.prev_sib].next_sib = x.next_sib;
    else p.head = x.next_sib;
    if (x.next_sib != kNone) nodes_[x.next_sib].prev_sib = x.prev_sib;
    else p.tail = x.prev_sib;
    x.prev_sib = x.next_sib = kNone;
  }

  // Puts detached node n into its parent's list between a and b (either kNone: an end),
  // where its count fits, and into the group of its count there.
  void attach(int32_t n, int32_t a, int32_t b) {
    Node& x = nodes_[n];
    Node& p = nodes_[x.parent];
    x.prev_sib = a;
    x.next_sib = b;
    if (a != kNone) nodes_[a].next_sib = n;
    else p.head = n;
    if (b != kNone) nodes_[b].prev_sib = n;
    else p.tail = n;
    if (a != kNone && nodes_[a].count == x.count) {
      x.group = nodes_[a].group;
    } else if (b != kNone && nodes_[b].count == x.count) {
      x.group = nodes_[b].group;
      groups_[x.group].first = n;
    } else {
      x.group = new_group(n);
      link_group(x.group, a == kNone ? kNone : nodes_[a].group,
                 b == kNone ? kNone : nodes_[b].group);
    }
  }

  // A new child (its token and count set) goes last under `parent`.
  void link(int32_t parent, int32_t child) {
    nodes_[child].parent = parent;
    attach(child, nodes_[parent].tail, kNone);
    nodes_[parent].num_children += 1;
    lookup_[key(parent, nodes_[child].token)] = child;
  }

  void unlink(int32_t child) {
    Node& c = nodes_[child];
    int32_t parent = c.parent;
    lookup_.erase(key(parent, c.token));
    detach(child);
    nodes_[parent].num_children -= 1;
  }

  void increment(int32_t n) {
    Node& x = nodes_[n];
    int32_t a = x.prev_sib;
    if (a != kNone && nodes_[a].count <= x.count + 1) {
      int32_t first = groups_[nodes_[a].group].first;
      detach(n);
      nodes_[n].count += 1;
      attach(n, nodes_[first].prev_sib, first);
    } else {  // stays; leaves its group if others share its old count
      detach(n);
      nodes_[n].count += 1;
      attach(n, a, a == kNone ? nodes_[nodes_[n].parent].head : nodes_[a].next_sib);
    }
  }

  void decrement(int32_t n) {
    Node& x = nodes_[n];
    int32_t lower = groups_[x.group].next;  // the siblings of the next lower count
    int32_t b = lower == kNone ? kNone : groups_[lower].first;
    int32_t a = b == kNone ? nodes_[x.parent].tail : nodes_[b].prev_sib;
    if (a == n) a = x.prev_sib;
    detach(n);
    nodes_[n].count -= 1;
    attach(n, a, b);
  }

  // `fresh` (detached, its token set) takes `old`'s place and count under old's parent.
  void replace(int32_t old, int32_t fresh) {
    Node& o = nodes_[old];
    Node& f = nodes_[fresh];
    f.parent = o.parent;
    f.count = o.count;
    f.prev_sib = o.prev_sib;
    f.next_sib = o.next_sib;
    f.group = o.group;
    Node& p = nodes_[o.parent];
    if (o.prev_sib != kNone) nodes_[o.prev_sib].next_sib = fresh;
    else p.head = fresh;
    if (o.next_sib != kNone) nodes_[o.next_sib].prev_sib = fresh;
    else p.tail = fresh;
    if (groups_[o.group].first == old) groups_[o.group].first = fresh;
    o.group = kNone;
    lookup_[key(o.parent, f.token)] = fresh;
  }

  void free_node(int32_t node) {
    Node& n = nodes_[node];
    int32_t seq = n.ref_seq;
    n = Node{};
    free_.push_back(node);
    if (seq != kNone) unref(seq);
  }

  void drop_subtree(int32_t node) {
    unlink(node);
    std::vector<int32_t> stack{node};
    while (!stack.empty()) {
      int32_t n = stack.back();
      stack.pop_back();
      for (int32_t c = nodes_[n].head; c != kNone; c = nodes_[c].next_sib) {
        lookup_.erase(key(n, nodes_[c].token));
        if (groups_[nodes_[c].group].first == c) free_groups_.push_back(nodes_[c].group);
        stack.push_back(c);
      }
      free_node(n);
    }
  }

  // Extends sequence s's live suffixes by `token` (s's tokens[pos] after the push).
  void append(int32_t s, int32_t token) {
    Seq& seq = seqs_.at(s);
    seq.tokens.push_back(token);
    const int32_t pos = static_cast<int32_t>(seq.tokens.size()) - 1;
    seq.active.push_back(0);
    nodes_[0].count += 1;
    if (static_cast<int64_t>(seq.active.size()) > max_depth_) seq.active.pop_front();
    for (int32_t& at : seq.active) at = extend_suffix(s, at, token, pos);
  }

  // The node where the suffix ending at `node` ends once extended by `token` (at pos).
  int32_t extend_suffix(int32_t s, int32_t node, int32_t token, int32_t pos) {
    int32_t child = find_child(node, token);
    if (child == kNone) {
      Node& n = nodes_[node];
      if (node != 0 && n.count == 1 && n.num_children == 0) {  // this suffix's own leaf
        set_ref(node, s, pos - n.length);
        nodes_[node].length += 1;
        return node;
      }
      int32_t leaf = alloc();
      Node& l = nodes_[leaf];
      l.token = token;
      l.length = 1;
      l.count = 1;
      set_ref(leaf, s, pos);
      link(node, leaf);
      return leaf;
    }
    if (node != 0 && nodes_[node].num_children == 1 &&
        nodes_[node].count == nodes_[child].count + 1) {
      // Only this suffix ends at `node`; the rest go on into `child`: grow node's edge.
      Node& n = nodes_[node];
      int32_t grown = n.length + 1;
      if (nodes_[child].length == 1) {  // the child is used up: it takes node's place
        lookup_.erase(key(node, token));
        free_groups_.push_back(nodes_[child].group);  // it was node's only child
        nodes_[child].token = n.token;
        replace(node, child);
        nodes_[child].length = grown;
        set_ref(child, s, pos + 1 - grown);
        free_node(node);
        return child;
      }
      set_ref(node, s, pos + 1 - grown);
      nodes_[node].length = grown;
      Node& c = nodes_[child];
      lookup_.erase(key(node, c.token));
      c.ref_idx += 1;
      c.length -= 1;
      c.token = seqs_.at(c.ref_seq).tokens[c.ref_idx];
      lookup_[key(node, c.token)] = child;
      return node;
    }
    if (nodes_[child].length > 1) {  // split off the child's first token
      int32_t head = alloc();
      Node& h = nodes_[head];
      h.token = token;
      h.length = 1;
      replace(child, head);
      set_ref(head, nodes_[child].ref_seq, nodes_[child].ref_idx);
      Node& c = nodes_[child];
      c.ref_idx += 1;
      c.length -= 1;
      c.token = seqs_.at(c.ref_seq).tokens[c.ref_idx];
      c.prev_sib = c.next_sib = c.group = kNone;
      link(head, child);
      child = head;
    }
    increment(child);
    return child;
  }

  // Walks the pattern from the root: the node and offset in its edge where it ends.
  bool match(const int32_t* pattern, int64_t len, int32_t* out_node, int32_t* out_idx) const {
    int32_t node = 0, idx = 0;
    const int32_t* edge = nullptr;
    for (int64_t i = 0; i < len; ++i) {
      if (idx == nodes_[node].length) {
        node = find_child(node, pattern[i]);
        if (node == kNone) return false;
        const Node& n = nodes_[node];
        edge = seqs_.at(n.ref_seq).tokens.data() + n.ref_idx;
        idx = 0;
      }
      if (edge[idx] != pattern[i]) return false;
      ++idx;
    }
    *out_node = node;
    *out_idx = idx;
    return true;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_continuum_C, m) {
  m.class_<SuffixTree>("SuffixTree")
      .def(torch::init<int64_t>())
      .def("extend", &SuffixTree::extend)
      .def("remove", &SuffixTree::remove)
      .def("speculate", &SuffixTree::speculate)
      .def("num_nodes", &SuffixTree::num_nodes)
      .def("check_invariants", &SuffixTree::check_invariants);
}
