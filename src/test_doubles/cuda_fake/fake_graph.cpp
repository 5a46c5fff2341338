// The fake libcuda's explicit graphs (see fake_cuda.h). A launch runs every node once, in a random order drawn
// from a seeded stream among the nodes whose declared dependencies have all run: any order a GPU could choose.
// A graph whose edges miss a real dependency therefore gives a different answer for some seed.
#include <algorithm>
#include <atomic>
#include <map>
#include <cstring>
#include <memory>
#include <random>

#include "fake_cuda.h"

namespace lily::cuda_fake {

namespace {

enum class NodeKind { kernel, copy, fill, empty };

struct Node {
  NodeKind kind = NodeKind::empty;
  std::vector<size_t> dependencies;  // indices of earlier nodes of the same graph
  // kernel
  Function* function = nullptr;
  unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1};
  unsigned shared_bytes = 0;
  KernelParams params{};
  // copy and fill
  uintptr_t dst = 0, src = 0;
  size_t bytes = 0;
  uint8_t value = 0;
};

struct Graph {
  std::vector<std::unique_ptr<Node>> nodes;
};

struct GraphExec {
  std::vector<Node> nodes;  // a copy: changing the graph later does not change what was instantiated
  std::map<const Node*, size_t> index;  // graph node -> its copy here
};

std::atomic<uint64_t>& graph_launches() {
  static std::atomic<uint64_t> n{0};
  return n;
}

CUresult add(CUgraphNode* out, CUgraph graph, const CUgraphNode* dependencies, size_t count, Node node) {
  if (!graph || !out || (count && !dependencies)) return fail(CUDA_ERROR_INVALID_VALUE, "cuGraphAdd*Node arguments");
  Graph& g = *reinterpret_cast<Graph*>(graph);
  for (size_t i = 0; i < count; ++i) {
    auto it = std::find_if(g.nodes.begin(), g.nodes.end(),
                           [&](const auto& n) { return n.get() == reinterpret_cast<Node*>(dependencies[i]); });
    if (it == g.nodes.end()) return fail(CUDA_ERROR_INVALID_VALUE, "a dependency is not a node of this graph");
    node.dependencies.push_back(size_t(it - g.nodes.begin()));
  }
  g.nodes.push_back(std::make_unique<Node>(node));
  *out = reinterpret_cast<CUgraphNode>(g.nodes.back().get());
  return CUDA_SUCCESS;
}

CUresult kernel_node(const CUDA_KERNEL_NODE_PARAMS* p, Node& node) {
  if (!p || !p->func || !p->kernelParams || p->extra) {
    return fail(CUDA_ERROR_INVALID_VALUE, "kernel node: a function and kernelParams are required (no extra, kern)");
  }
  node.kind = NodeKind::kernel;
  node.function = reinterpret_cast<Function*>(p->func);
  const unsigned grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ};
  const unsigned block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
  std::copy(grid, grid + 3, node.grid);
  std::copy(block, block + 3, node.block);
  node.shared_bytes = p->sharedMemBytes;
  std::memcpy(&node.params, p->kernelParams[0], sizeof(KernelParams));  // the driver copies the arguments
  return CUDA_SUCCESS;
}

CUresult run(const Node& node) {
  switch (node.kind) {
    case NodeKind::kernel:
      return run_kernel(*node.function, node.grid, node.block, node.shared_bytes, &node.params);
    case NodeKind::copy:
      if (bytes_to_end(reinterpret_cast<void*>(node.dst)) < node.bytes ||
          bytes_to_end(reinterpret_cast<void*>(node.src)) < node.bytes) {
        return fail(CUDA_ERROR_ILLEGAL_ADDRESS, "graph copy node reaches outside a device allocation");
      }
      std::memmove(reinterpret_cast<void*>(node.dst), reinterpret_cast<const void*>(node.src), node.bytes);
      return CUDA_SUCCESS;
    case NodeKind::fill:
      if (bytes_to_end(reinterpret_cast<void*>(node.dst)) < node.bytes) {
        return fail(CUDA_ERROR_ILLEGAL_ADDRESS, "graph memset node reaches outside a device allocation");
      }
      std::memset(reinterpret_cast<void*>(node.dst), node.value, node.bytes);
      return CUDA_SUCCESS;
    case NodeKind::empty:
      return CUDA_SUCCESS;
  }
  return CUDA_ERROR_UNKNOWN;
}

}  // namespace

CUresult fake_GraphCreate(CUgraph* graph, unsigned int flags) {
  if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuGraphCreate flags must be 0");
  *graph = reinterpret_cast<CUgraph>(new Graph);
  return CUDA_SUCCESS;
}

CUresult fake_GraphDestroy(CUgraph graph) {
  delete reinterpret_cast<Graph*>(graph);
  return CUDA_SUCCESS;
}

CUresult fake_GraphAddKernelNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* dependencies, size_t count,
                                 const CUDA_KERNEL_NODE_PARAMS* params) {
  Node n;
  if (CUresult r = kernel_node(params, n)) return r;
  return add(node, graph, dependencies, count, n);
}

// One linear copy between device addresses (what Lily's driver layer adds); anything else is refused.
CUresult fake_GraphAddMemcpyNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* dependencies, size_t count,
                                 const CUDA_MEMCPY3D* copy, CUcontext) {
  if (!copy || copy->srcMemoryType != CU_MEMORYTYPE_DEVICE || copy->dstMemoryType != CU_MEMORYTYPE_DEVICE ||
      copy->Height != 1 || copy->Depth != 1 || copy->srcXInBytes || copy->dstXInBytes || copy->srcY ||
      copy->dstY || copy->srcZ || copy->dstZ) {
    return fail(CUDA_ERROR_INVALID_VALUE, "the fake's memcpy nodes are 1-D device-to-device copies");
  }
  Node n;
  n.kind = NodeKind::copy;
  n.dst = copy->dstDevice;
  n.src = copy->srcDevice;
  n.bytes = copy->WidthInBytes;
  return add(node, graph, dependencies, count, n);
}

CUresult fake_GraphAddMemsetNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* dependencies, size_t count,
                                 const CUDA_MEMSET_NODE_PARAMS* params, CUcontext) {
  if (!params || params->elementSize != 1 || params->height != 1) {
    return fail(CUDA_ERROR_INVALID_VALUE, "the fake's memset nodes are 1-D with 1-byte elements");
  }
  Node n;
  n.kind = NodeKind::fill;
  n.dst = params->dst;
  n.bytes = params->width;
  n.value = uint8_t(params->value);
  return add(node, graph, dependencies, count, n);
}

CUresult fake_GraphAddEmptyNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* dependencies, size_t count) {
  return add(node, graph, dependencies, count, Node{});
}

// Programmatic edges between two kernels (what Lily adds), run as full dependencies: the fake cannot start a kernel
// part-way, so it checks the edge and orders the two nodes. Anything else is refused.
CUresult fake_GraphAddDependencies(CUgraph graph, const CUgraphNode* from, const CUgraphNode* to,
                                   const CUgraphEdgeData* edges, size_t count) {
  if (!graph || !from || !to || !edges) return fail(CUDA_ERROR_INVALID_VALUE, "cuGraphAddDependencies_v2 arguments");
  Graph& g = *reinterpret_cast<Graph*>(graph);
  const auto find = [&](CUgraphNode n) {
    return std::find_if(g.nodes.begin(), g.nodes.end(),
                        [&](const auto& p) { return p.get() == reinterpret_cast<Node*>(n); });
  };
  for (size_t i = 0; i < count; ++i) {
    const CUgraphEdgeData& e = edges[i];
    const bool zero_reserved = std::all_of(e.reserved, e.reserved + 5, [](unsigned char c) { return c == 0; });
    if (e.from_port != CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC || e.to_port != 0 ||
        e.type != CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC || !zero_reserved) {
      return fail(CUDA_ERROR_INVALID_VALUE, "the fake's typed edges are programmatic ones from a kernel's port");
    }
    const auto upstream = find(from[i]), downstream = find(to[i]);
    if (upstream == g.nodes.end() || downstream == g.nodes.end() || upstream >= downstream ||
        (*upstream)->kind != NodeKind::kernel || (*downstream)->kind != NodeKind::kernel) {
      return fail(CUDA_ERROR_INVALID_VALUE, "a programmatic edge joins an earlier kernel node to a later one");
    }
    (*downstream)->dependencies.push_back(size_t(upstream - g.nodes.begin()));
  }
  return CUDA_SUCCESS;
}

CUresult fake_GraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long flags) {
  if (!graph || flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuGraphInstantiateWithFlags: flags must be 0");
  const Graph& g = *reinterpret_cast<Graph*>(graph);
  auto e = std::make_unique<GraphExec>();
  for (const auto& n : g.nodes) {
    e->index[n.get()] = e->nodes.size();
    e->nodes.push_back(*n);
  }
  *exec = reinterpret_cast<CUgraphExec>(e.release());
  return CUDA_SUCCESS;
}

CUresult fake_GraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS* params) {
  GraphExec& e = *reinterpret_cast<GraphExec*>(exec);
  auto it = e.index.find(reinterpret_cast<const Node*>(node));
  if (it == e.index.end() || e.nodes[it->second].kind != NodeKind::kernel) {
    return fail(CUDA_ERROR_INVALID_VALUE, "cuGraphExecKernelNodeSetParams: not a kernel node of this graph");
  }
  Node updated = e.nodes[it->second];
  if (CUresult r = kernel_node(params, updated)) return r;
  e.nodes[it->second] = updated;
  return CUDA_SUCCESS;
}

// Runs the nodes in a random topological order: each step picks uniformly among the nodes whose dependencies ran.
CUresult fake_GraphLaunch(CUgraphExec exec, CUstream) {
  const GraphExec& e = *reinterpret_cast<GraphExec*>(exec);
  std::mt19937_64 random(launch_seed(graph_launches()++));
  std::vector<size_t> waiting(e.nodes.size());
  std::vector<std::vector<size_t>> dependents(e.nodes.size());
  std::vector<size_t> ready;
  for (size_t i = 0; i < e.nodes.size(); ++i) {
    waiting[i] = e.nodes[i].dependencies.size();
    for (size_t d : e.nodes[i].dependencies) dependents[d].push_back(i);
    if (!waiting[i]) ready.push_back(i);
  }
  while (!ready.empty()) {
    const size_t pick = std::uniform_int_distribution<size_t>(0, ready.size() - 1)(random);
    const size_t i = ready[pick];
    ready.erase(ready.begin() + long(pick));
    if (CUresult r = run(e.nodes[i])) return r;
    for (size_t next : dependents[i]) {
      if (--waiting[next] == 0) ready.push_back(next);
    }
  }
  return CUDA_SUCCESS;
}

CUresult fake_GraphExecDestroy(CUgraphExec exec) {
  delete reinterpret_cast<GraphExec*>(exec);
  return CUDA_SUCCESS;
}

}  // namespace lily::cuda_fake
