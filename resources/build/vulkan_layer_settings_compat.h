/* Warmslot: llama.cpp's Vulkan backend names VK_EXT_layer_settings (Vulkan headers 1.3.261+)
   unconditionally; older headers (Debian 12: 1.3.239) lack it. These definitions have the
   extension's layout; the struct is only read by a loader or layer that knows the extension. */
#pragma once
#ifdef __cplusplus
#include <vulkan/vulkan_core.h>
#if VK_HEADER_VERSION < 261
#include <cstdint>
#include <vector>
namespace vk {
enum class LayerSettingTypeEXT : int32_t {
    eBool32 = 0, eInt32 = 1, eInt64 = 2, eUint32 = 3, eUint64 = 4, eFloat32 = 5, eFloat64 = 6,
    eString = 7
};
struct LayerSettingEXT {
    const char * pLayerName;
    const char * pSettingName;
    LayerSettingTypeEXT type;
    uint32_t valueCount;
    const void * pValues;
};
struct LayerSettingsCreateInfoEXT {
    VkStructureType sType = static_cast<VkStructureType>(1000496000);
    const void * pNext = nullptr;
    uint32_t settingCount = 0;
    const LayerSettingEXT * pSettings = nullptr;
    explicit LayerSettingsCreateInfoEXT(const std::vector<LayerSettingEXT> & s)
        : settingCount(static_cast<uint32_t>(s.size())), pSettings(s.data()) {}
};
}  // namespace vk
#endif
#endif
