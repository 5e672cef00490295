// The count trie of SuffixDecoding (pagedllm/spec_decode/suffix_tree.py states the
// structure, its invariants and the drafting rule; this is the same algorithm, step for
// step, so both give the same drafts and node counts). Registered as the torch class
// torch.classes.pagedllm_cpu.SuffixTree.
//
// Nodes are indices into parallel vectors; node 0 is the root. A node holds a run of
// len_ tokens read from its reference seqs_[seq_][pos_ ...] and the count shared by the
// run. Sequence ids are the caller's; tokens are non-negative 32-bit ids.

#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

constexpr int32_t kRoot = 0;
constexpr int32_t kNone = -1;

using Draft = std::tuple<std::vector<int64_t>, double>;

class SuffixTree : public torch::CustomClassHolder {
 public:
  explicit SuffixTree(int64_t depth) : depth_(depth) {
    TORCH_CHECK(depth >= 1, "SuffixTree: depth must be positive, got ", depth);
    new_slot();  // the root
    parent_[kRoot] = kNone;
  }

  // Appends tokens to sequence seq_id (a new one when unknown), keeping the nodes where
  // its unfinished strings end so that later appends and draft_after continue them.
  void extend(int64_t seq_id, const std::vector<int64_t>& tokens) {
    std::vector<int32_t>& seq = seqs_[seq_id];
    std::vector<int32_t>& active = active_[seq_id];
    for (int64_t t : tokens) {
      TORCH_CHECK(t >= 0 && t <= INT32_MAX, "SuffixTree: token id out of range: ", t);
      seq.push_back(static_cast<int32_t>(t));
      append(seq_id, seq, active);
    }
  }

  // Stores a whole sequence that will not grow.
  void insert(int64_t seq_id, const std::vector<int64_t>& tokens) {
    TORCH_CHECK(!seqs_.count(seq_id), "SuffixTree: sequence ", seq_id, " is already stored");
    extend(seq_id, tokens);
    active_.erase(seq_id);
  }

  // Removes every string of seq_id, which must be the oldest sequence stored.
  void remove(int64_t seq_id) {
    auto found = seqs_.find(seq_id);
    TORCH_CHECK(found != seqs_.end(), "SuffixTree: unknown sequence ", seq_id);
    const std::vector<int32_t>& tokens = found->second;
    std::unordered_set<int32_t> stale;  // nodes whose best child lost count
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (int64_t q = 0; q < n; ++q) {
      const int64_t end = std::min<int64_t>(depth_, n - q);
      count_[kRoot] -= 1;
      int32_t node = kRoot;
      int64_t d = 0;
      while (d < end) {
        const int32_t child = children_[node]->at(tokens[q + d]);
        count_[child] -= 1;
        if (node != kRoot && best_[node] == child) stale.insert(node);
        if (count_[child] == 0) {
          drop(node, tokens[q + d]);
          break;
        }
        node = child;
        d += len_[child];
      }
      // node lost its ending string or a child: it may now hold a single child of its
      // own count (elsewhere on the path both sides lost the same count)
      const auto& kids = children_[node];
      if (node != kRoot && kids && kids->size() == 1) {
        const int32_t child = kids->begin()->second;
        if (count_[child] == count_[node]) merge(node, child);
      }
    }
    for (int32_t node : stale) {
      if (count_[node] > 0) best_[node] = max_child(node);
    }
    seqs_.erase(seq_id);
    active_.erase(seq_id);
  }

  // The best draft following sequence seq_id's last m tokens, over every m its active
  // strings give (1 .. depth - 1).
  Draft draft_after(int64_t seq_id, int64_t max_tokens, double factor, double min_prob) const {
    auto found = active_.find(seq_id);
    TORCH_CHECK(found != active_.end(), "SuffixTree: no growing sequence ", seq_id);
    std::vector<std::pair<int32_t, int32_t>> matches;
    for (auto it = found->second.rbegin(); it != found->second.rend(); ++it) {
      matches.emplace_back(*it, len_[*it]);
    }
    return best_draft(matches, max_tokens, factor, min_prob);
  }

  // The best draft following the last m tokens of context, over every m whose string is
  // stored (1 .. min(len(context), depth - 1)).
  Draft draft_matching(const std::vector<int64_t>& context, int64_t max_tokens, double factor,
                       double min_prob) const {
    std::vector<std::pair<int32_t, int32_t>> matches;
    const int64_t longest = std::min<int64_t>(static_cast<int64_t>(context.size()), depth_ - 1);
    for (int64_t m = 1; m <= longest; ++m) {
      int32_t node = 0, idx = 0;
      if (!match(context, m, node, idx)) break;  // a longer suffix holds this one
      matches.emplace_back(node, idx);
    }
    return best_draft(matches, max_tokens, factor, min_prob);
  }

  int64_t num_nodes() const { return num_nodes_; }

 private:
  void append(int64_t seq_id, const std::vector<int32_t>& seq, std::vector<int32_t>& active) {
    const int32_t p = static_cast<int32_t>(seq.size()) - 1;
    const int32_t t = seq[p];
    count_[kRoot] += 1;
    active.push_back(kRoot);
    for (int32_t& node : active) node = step(node, seq_id, p, t);
    if (static_cast<int64_t>(active.size()) == depth_) {
      active.erase(active.begin());  // that string has reached the depth
    }
  }

  int32_t step(int32_t node, int64_t seq_id, int32_t p, int32_t t) {
    auto& kids = children_[node];
    int32_t child = kNone;
    if (kids) {
      auto found = kids->find(t);
      if (found != kids->end()) child = found->second;
    }
    if (child == kNone) {
      if (node != kRoot && count_[node] == 1) {
        // only this string reaches node: a leaf whose reference is this very string,
        // so its run grows in place
        len_[node] += 1;
        return node;
      }
      child = new_node(seq_id, p, node, 1, 1);
      auto& parent_kids = children_[node];  // new_node may have moved the vectors
      if (!parent_kids) parent_kids = std::make_unique<std::unordered_map<int32_t, int32_t>>();
      (*parent_kids)[t] = child;
    } else {
      if (len_[child] > 1) child = split(node, child, t);
      count_[child] += 1;
      seq_[child] = seq_id;
      pos_[child] = p;
    }
    if (node != kRoot) {
      if (count_[child] == count_[node]) {
        merge(node, child);  // the last string ending at node left it
      } else {
        raise_best(node, child, t);
      }
    }
    return child;
  }

  void raise_best(int32_t node, int32_t child, int32_t t) {
    const int32_t best = best_[node];
    if (best == child) return;
    if (best == kNone) {
      best_[node] = child;
      return;
    }
    const int64_t c = count_[child], b = count_[best];
    if (c > b || (c == b && t < first_token(best))) best_[node] = child;
  }

  int32_t max_child(int32_t node) const {
    const auto& kids = children_[node];
    if (!kids) return kNone;
    int32_t best = kNone, best_token = 0;
    for (const auto& [token, child] : *kids) {
      if (best == kNone || count_[child] > count_[best] ||
          (count_[child] == count_[best] && token < best_token)) {
        best = child;
        best_token = token;
      }
    }
    return best;
  }

  int32_t first_token(int32_t node) const { return seqs_.at(seq_[node])[pos_[node]]; }

  int32_t new_slot() {
    count_.push_back(0);
    seq_.push_back(0);
    pos_.push_back(0);
    len_.push_back(0);
    parent_.push_back(kNone);
    best_.push_back(kNone);
    children_.emplace_back();
    return static_cast<int32_t>(count_.size()) - 1;
  }

  int32_t new_node(int64_t seq_id, int32_t pos, int32_t parent, int64_t count, int32_t length) {
    num_nodes_ += 1;
    int32_t node;
    if (!free_.empty()) {
      node = free_.back();
      free_.pop_back();
    } else {
      node = new_slot();
    }
    count_[node] = count;
    seq_[node] = seq_id;
    pos_[node] = pos;
    len_[node] = length;
    parent_[node] = parent;
    return node;
  }

  void free_node(int32_t node) {
    num_nodes_ -= 1;
    count_[node] = 0;
    best_[node] = kNone;
    children_[node].reset();
    free_.push_back(node);
  }

  // Cuts child's run after its first token; the new upper node.
  int32_t split(int32_t node, int32_t child, int32_t t) {
    const int32_t pos = pos_[child];
    const int32_t second = seqs_.at(seq_[child])[pos + 1];
    const int32_t upper = new_node(seq_[child], pos, node, count_[child], 1);
    children_[upper] = std::make_unique<std::unordered_map<int32_t, int32_t>>();
    (*children_[upper])[second] = child;
    best_[upper] = child;
    pos_[child] = pos + 1;
    len_[child] -= 1;
    parent_[child] = upper;
    (*children_[node])[t] = upper;
    if (best_[node] == child) best_[node] = upper;
    return upper;
  }

  // Folds node into its only child of equal count; no string ends at node.
  void merge(int32_t node, int32_t child) {
    const int32_t parent = parent_[node];
    const int32_t t = first_token(node);
    pos_[child] -= len_[node];
    len_[child] += len_[node];
    parent_[child] = parent;
    (*children_[parent])[t] = child;
    if (best_[parent] == node) best_[parent] = child;
    free_node(node);
  }

  // Deletes node's child t and its subtree, a chain whose counts are 0.
  void drop(int32_t node, int32_t t) {
    auto& kids = children_[node];
    int32_t child = kids->at(t);
    kids->erase(t);
    if (kids->empty()) kids.reset();
    while (child != kNone) {
      const auto& below = children_[child];
      const int32_t next = below ? below->begin()->second : kNone;
      free_node(child);
      child = next;
    }
  }

  // Where the path of context's last m tokens ends (node, offset in its run).
  bool match(const std::vector<int64_t>& context, int64_t m, int32_t& node, int32_t& idx) const {
    node = kRoot;
    idx = 0;
    const int64_t n = static_cast<int64_t>(context.size());
    for (int64_t i = n - m; i < n; ++i) {
      const int64_t t = context[i];
      if (idx == len_[node]) {
        const auto& kids = children_[node];
        if (!kids || t < 0 || t > INT32_MAX) return false;
        auto found = kids->find(static_cast<int32_t>(t));
        if (found == kids->end()) return false;
        node = found->second;
        idx = 1;
      } else if (seqs_.at(seq_[node])[pos_[node] + idx] == t) {
        idx += 1;
      } else {
        return false;
      }
    }
    return true;
  }

  // The most frequent continuation (at most limit tokens) after offset idx of node's run.
  Draft draft(int32_t node, int32_t idx, int64_t limit, double min_prob) const {
    const std::vector<int32_t>* ref = &seqs_.at(seq_[node]);
    int32_t start = pos_[node];
    std::vector<int64_t> out;
    double prob = 1.0, score = 0.0;
    while (static_cast<int64_t>(out.size()) < limit) {
      if (idx == len_[node]) {
        const int32_t child = best_[node];
        if (child == kNone) break;
        prob *= static_cast<double>(count_[child]) / static_cast<double>(count_[node]);
        if (prob < min_prob) break;
        node = child;
        idx = 0;
        ref = &seqs_.at(seq_[node]);
        start = pos_[node];
      }
      out.push_back((*ref)[start + idx]);
      score += prob;
      idx += 1;
    }
    return {std::move(out), score};
  }

  // The best-scoring draft over matches[m - 1] of match length m; ties: the longer.
  Draft best_draft(const std::vector<std::pair<int32_t, int32_t>>& matches, int64_t max_tokens,
                   double factor, double min_prob) const {
    Draft best(std::vector<int64_t>{}, 0.0);
    for (size_t i = 0; i < matches.size(); ++i) {
      const int64_t m = static_cast<int64_t>(i) + 1;
      const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(m * factor + 1e-6));
      if (limit > 0) {
        Draft candidate = draft(matches[i].first, matches[i].second, limit, min_prob);
        if (std::get<1>(candidate) >= std::get<1>(best)) best = std::move(candidate);
      }
    }
    return best;
  }

  int64_t depth_;
  std::unordered_map<int64_t, std::vector<int32_t>> seqs_;
  std::unordered_map<int64_t, std::vector<int32_t>> active_;  // growing sequences only
  std::vector<int64_t> count_;
  std::vector<int64_t> seq_;
  std::vector<int32_t> pos_;
  std::vector<int32_t> len_;
  std::vector<int32_t> parent_;
  std::vector<int32_t> best_;
  std::vector<std::unique_ptr<std::unordered_map<int32_t, int32_t>>> children_;
  std::vector<int32_t> free_;
  int64_t num_nodes_ = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<SuffixTree>("SuffixTree")
      .def(torch::init<int64_t>())
      .def("extend", &SuffixTree::extend)
      .def("insert", &SuffixTree::insert)
      .def("remove", &SuffixTree::remove)
      .def("draft_after", &SuffixTree::draft_after)
      .def("draft_matching", &SuffixTree::draft_matching)
      .def("num_nodes", &SuffixTree::num_nodes);
}
