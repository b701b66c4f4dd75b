// Worker addresses as the flags give them: host:port or dns:///name:port.
#pragma once

#include <string>
#include <vector>

namespace dgserve {

// dns:///host:port → every address host resolves to now, as ip:port ([v6]:port), sorted and
// unique (empty when it does not resolve); anything else → itself.
std::vector<std::string> ExpandTarget(const std::string& target);

}  // namespace dgserve
