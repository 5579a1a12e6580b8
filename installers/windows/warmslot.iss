; Inno Setup 6 script: a per-user Windows installer for the PyInstaller folder.
;
;   installers\windows\build.ps1          (builds the folder, then runs ISCC on this file)
;   ISCC /DAppVersion=0.1.0 /DSourceDir=...\dist\warmslot /DOutputDir=...\dist warmslot.iss
;
; Installs to %LOCALAPPDATA%\Programs\Warmslot without administrator rights,
; adds a Start-menu entry and, optionally, a desktop icon and a Startup-folder
; shortcut (start at login). The uninstaller offers, with a warning, to delete
; %LOCALAPPDATA%\warmslot (settings, caches, saved KV-cache slots, telemetry,
; logs, models); it never does so silently.

#ifndef AppVersion
  #define AppVersion "0.0.0"
#endif
#ifndef SourceDir
  #define SourceDir "dist\warmslot"
#endif
#ifndef OutputDir
  #define OutputDir "dist"
#endif

[Setup]
; The AppId identifies Warmslot for upgrades and uninstall: never change it.
AppId={{CB9F0999-EF2A-4EE1-A4F7-DBDA8D18F6DA}
AppName=Warmslot
AppVersion={#AppVersion}
AppVerName=Warmslot {#AppVersion}
AppPublisher=Warmslot
DefaultDirName={autopf}\Warmslot
DefaultGroupName=Warmslot
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#OutputDir}
OutputBaseFilename=warmslot-{#AppVersion}-windows-x64-setup
SetupIconFile=..\..\resources\installer\warmslot.ico
UninstallDisplayIcon={app}\warmslot-tray.exe
UninstallDisplayName=Warmslot
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern
CloseApplications=yes
RestartApplications=no

[Tasks]
Name: "startatlogin"; Description: "Start Warmslot when I sign in"; GroupDescription: "Startup:"; Flags: unchecked
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[InstallDelete]
; An upgrade replaces the whole private runtime, never mixes two versions.
Type: filesandordirs; Name: "{app}\_internal"

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{userprograms}\Warmslot"; Filename: "{app}\warmslot-tray.exe"; WorkingDir: "{app}"; Comment: "Keep llama-server's prompt cache warm"
Name: "{userdesktop}\Warmslot"; Filename: "{app}\warmslot-tray.exe"; WorkingDir: "{app}"; Tasks: desktopicon
Name: "{userstartup}\Warmslot"; Filename: "{app}\warmslot-tray.exe"; WorkingDir: "{app}"; Tasks: startatlogin

[Run]
Filename: "{app}\warmslot-tray.exe"; Description: "Start Warmslot now"; Flags: nowait postinstall skipifsilent

[UninstallRun]
; Stop the tray and a headless `warmslot serve` (and their llama-server, /T) first.
Filename: "{sys}\taskkill.exe"; Parameters: "/F /T /IM warmslot-tray.exe"; Flags: runhidden; RunOnceId: "StopTray"
Filename: "{sys}\taskkill.exe"; Parameters: "/F /T /IM warmslot.exe"; Flags: runhidden; RunOnceId: "StopCli"

[Code]
{ core/paths.py on Windows (platformdirs, appauthor=False): config, data and
  state in %LOCALAPPDATA%\warmslot, cache in ...\Cache, logs in ...\Logs. }
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  DataDir: String;
begin
  if CurUninstallStep <> usPostUninstall then
    Exit;
  DataDir := ExpandConstant('{localappdata}\warmslot');
  if UninstallSilent or not DirExists(DataDir) then
    Exit;
  if MsgBox('Also delete Warmslot''s data?' + #13#10#13#10 + DataDir + #13#10#13#10 +
            'It holds your settings, llama.cpp builds, saved KV-cache slots, telemetry, ' +
            'logs and downloaded or assembled models. This cannot be undone.' + #13#10#13#10 +
            'Choose No to keep it for a later install.',
            mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES then
    DelTree(DataDir, True, True, True);
end;
